"""The schedule explorer (simulate/explore/): a CI slice of its schedules, every bug it found as
a regression seed (which fails again once the fix is taken out), and the real tiny models under it.

The long run (docs/protocol.md): pipespec-explore --count 10000 --jobs 2
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipespec_mpi.config import DecodeConfig
from pipespec_mpi.simulate.explore import FAMILIES, ExGate, Parts, Scenario, World, explore, sweep
from pipespec_mpi.speculative import goodput
from pipespec_mpi.speculative import policy as policy_module
from pipespec_mpi.speculative.verifiers import AcceptAll, Leviathan
from pipespec_mpi.stage.loop import StageLoop
from pipespec_mpi.stage.mailbox import Mailbox

from ...speculative.test_sampling_power import tiny_parts


def test_a_slice_of_every_family_terminates_losslessly_with_counters_that_add_up():
    for tally in sweep(FAMILIES, count=25, start=100_000) + sweep(
        ["pipespec-greedy"], 30, preset="slurm-sweep"
    ):
        assert tally.counts == {"ok": tally.schedules}, tally.failures


@pytest.mark.long
def test_a_wider_slice_of_every_family_terminates_losslessly():
    for tally in sweep(FAMILIES, count=100, start=100_025):
        assert tally.counts == {"ok": tally.schedules}, tally.failures


# ------------------------------------------------------------------------------ regression seeds
# (family, seed, preset): found by the explorer on the loop without the fix named (docs/protocol.md)
# (slurm-sweep 127, then 366, reached P1 until the idle flag changed what stages publish, 63027e9 and
# the idle flag's downstream version; 1236 does now. pipespec-leviathan 54 reached P2 until then)
RESEND = [("pipespec-greedy", 235, None), ("sd-greedy", 18, None), ("pipespec-greedy", 1236, "slurm-sweep")]
# (pipespec-leviathan 20 and sd-leviathan 16 reached P2 until Leviathan's draws became one batch
# of tensor ops on the device: each seed now draws other random numbers)
ONCE = [("pipespec-leviathan", 2, None), ("sd-leviathan", 10, None)]
KEEP = [("pipespec-greedy", 16, None), ("pipespec-leviathan", 2, None), ("pipespec-greedy", 6, "slurm-sweep")]
# a stop request (run/drain.py) that each stage acts on alone, without the gate's vote
STOP = [("pipespec-greedy", 7, None), ("sd-greedy", 5, None), ("pipespec-leviathan", 6, None)]
# an adaptive wait for a model-free drafter's answer that ends by the clock alone (an own step's
# cost after the last forward) with no recheck set: a rank asleep on its doorbell slept past it
UNTIL = [("pipespec-greedy-adaptive", 37, None), ("pipespec-gumbel-adaptive", 136, None),
         ("pipespec-leviathan-adaptive", 266, None)]  # fmt: skip


def without_resend(monkeypatch) -> None:
    """P1 back in: a stage sends what its downstream is owed only right after acting (or to finish
    a send that ran out of buffers); an epoch change alone does not make it send again."""
    send, acted = StageLoop._send_owed, StageLoop._acted

    def act_then_send(self):
        self._after_act = True
        return acted(self)

    def send_after_acting(self):
        if not (getattr(self, "_after_act", False) or getattr(self, "_partial", False)):
            return False
        self._after_act = False
        out = send(self)
        self._partial = self.p.outbox.sent < len(self.p.out)
        return out

    monkeypatch.setattr(StageLoop, "_acted", act_then_send)
    monkeypatch.setattr(StageLoop, "_send_owed", send_after_acting)


def dropping_while_waiting(monkeypatch) -> None:
    """P3 back in: while a stage waits for the start of the next prompt, what arrives is dropped."""
    monkeypatch.setattr(Mailbox, "pump", lambda self: self.receiver and self.receiver.poll())


def stopping_alone(monkeypatch) -> None:
    """The stop without the vote: a stage that was asked to stop skips the job by itself, while its
    neighbours, not asked yet, start it and wait for it forever."""
    monkeypatch.setattr(ExGate, "stopped", lambda self: self.world.sc.stop_requested(self.me, self.seq))


def ignoring_stop(monkeypatch) -> None:
    """No stop at all: every job runs although the replica voted to stop."""
    monkeypatch.setattr(ExGate, "stopped", lambda self: False)


def wait_without_until(monkeypatch) -> None:
    """The answer's wait without its end: ``Decision.until`` never set, so no recheck is due."""
    rule = policy_module.adaptive_rule
    monkeypatch.setattr(policy_module, "adaptive_rule", lambda *a: replace(rule(*a), until=None))


def resending_leviathan(monkeypatch) -> None:
    """P2 back in: Leviathan tokens are sent again after an epoch change, like greedy ones."""
    monkeypatch.setattr(Leviathan, "resendable", True)


@pytest.mark.parametrize("family,seed,preset", RESEND + ONCE + KEEP + STOP + UNTIL)
def test_regression_seed_passes(family, seed, preset):
    assert explore(family, seed, preset).ok


@pytest.mark.parametrize(
    "family,seed,preset,bug,verdict",
    [(*c, without_resend, "stall") for c in RESEND]
    + [(*c, resending_leviathan, "error") for c in ONCE]
    + [(*c, dropping_while_waiting, "stall") for c in KEEP]
    + [(*c, stopping_alone, "stall") for c in STOP]
    + [(*c, ignoring_stop, "counter") for c in STOP]
    + [(*c, wait_without_until, "unrung") for c in UNTIL],
)
def test_regression_seed_fails_without_its_fix(monkeypatch, family, seed, preset, bug, verdict):
    bug(monkeypatch)
    found = explore(family, seed, preset)
    assert found.verdict == verdict, found


# a prompt's own token budget (a row's max_tokens: StageLoop.begin's max_new_tokens)
BUDGET = [("pipespec-greedy-batch", 0, "mismatch"), ("sd-greedy-suffix", 2, "mismatch"),
          ("pipespec-leviathan-suffix", 1, "counter")]  # fmt: skip


@pytest.mark.parametrize("family,seed,verdict", BUDGET)
def test_a_prompts_own_budget_is_kept_by_every_stage(monkeypatch, family, seed, verdict):
    assert Scenario.draw(family, seed).budgets and explore(family, seed).ok
    begin = StageLoop.begin
    monkeypatch.setattr(
        StageLoop,
        "begin",
        lambda self, p, m, v, max_new_tokens=None, store_key=None, idle=False: begin(self, p, m, v),
    )
    assert explore(family, seed).verdict == verdict


# the adaptive policy (decode.policy=adaptive): a forward timed at zero made its rates divide by zero
ZERO_COST = [("pipespec-greedy-adaptive", 2), ("pipespec-leviathan-adaptive", 1)]


@pytest.mark.parametrize("family,seed", ZERO_COST)
def test_a_forward_timed_at_zero_still_costs(monkeypatch, family, seed):
    assert explore(family, seed).ok
    monkeypatch.setattr(goodput, "MIN_COST_S", 0.0)
    found = explore(family, seed)
    assert found.verdict == "error" and "ZeroDivisionError" in found.detail, found


def test_the_adaptive_families_take_every_decision_of_the_policy():
    """Across a slice of seeds the adaptive policy waits, gives a wait up to join a batched
    forward, cuts verifications and holds drafters (estimates drawn anew at every decision, or
    learned on drifting clocks)."""
    seen = {"waits_chosen": 0, "waits_joined": 0, "verify_cut": 0, "drafts_held": 0, "own_steps": 0}
    for family in ("pipespec-greedy-adaptive", "pipespec-gumbel-adaptive"):
        for seed in range(40):
            world = World(Scenario.draw(family, seed))
            assert world.run().ok
            for outcome in world.outcomes.values():
                for key in seen:
                    seen[key] += getattr(outcome.stats, key)
    assert all(seen.values()), seen


def test_a_wrong_verifier_is_a_mismatch():
    sc = Scenario.draw("pipespec-greedy", 3)
    world = World(sc)
    parts = world.parts
    found = World(sc, Parts(parts.model, parts.prompts, parts.eos, AcceptAll)).run()
    assert found.verdict == "mismatch", found


@pytest.mark.parametrize("family", ["pipespec-greedy", "sd-greedy"])
def test_the_real_tiny_models_stay_lossless_under_adversarial_schedules(family):
    for seed in range(4):
        sc = Scenario.draw(family, seed, k=3, lookup=False, n_prompts=2,
                           decode=DecodeConfig(lookahead=seed % 3, sd_window=2, max_run_ahead=4,
                                               max_new_tokens=12))  # fmt: skip
        parts = tiny_parts()
        parts = Parts(parts.model, parts.prompts[:2], parts.eos)
        found = World(sc, parts).run()
        assert found.ok, found


def test_a_slot_that_finishes_takes_the_next_job_while_another_decodes_a_long_one():
    """Batched: the slots take their jobs from one queue (stage/deal.py), so the slot that drew
    the long prompt decodes it alone while the other one takes every short prompt; each prompt is
    decoded by the same slot on every stage, and greedy outputs equal AR (checked by ``run``)."""
    decode = DecodeConfig(lookahead=0, max_new_tokens=40, max_run_ahead=4, max_verify=4, policy="static")
    sc = replace(
        Scenario.draw("pipespec-greedy-batch", 0, k=3, decode=decode),
        slots=2, n_prompts=5, budgets=(40, 1, 1, 1, 1), eos_rate=0.0, stop_before=None, gate_delay=0,
        handoff_delay=0,
    )  # fmt: skip
    world = World(sc)
    assert world.run().ok
    last = sc.k - 1
    long_slot = world.decoded_by[(1, last)]
    assert [world.decoded_by[(seq, last)] for seq in range(2, 6)] == [1 - long_slot] * 4


def test_the_suffix_families_exercise_the_drafters_own_cuts():
    """With a drawn min_survival the real suffix drafter cuts drafts by its estimates (S_0 of its
    unconfirmed drafts included), forgets drafts whose context was rolled back and proposes again
    once its verifier confirms: its verifiers see it go idle and come back, in every schedule."""
    seen = {"cut": 0, "forgotten": 0, "proposals": 0}
    tried = 0
    for family in ("pipespec-greedy-suffix", "sd-leviathan-suffix", "pipespec-gumbel-suffix"):
        for seed in range(30):
            sc = Scenario.draw(family, seed)
            if sc.drafter_survival <= 0:
                continue
            tried += 1
            world = World(sc)
            assert world.run().ok
            for outcome in world.outcomes.values():
                d = outcome.stats.drafter
                if d:
                    seen["cut"] += d["cut"]
                    seen["forgotten"] += d["forgotten"]
                    seen["proposals"] += sum(d["proposals"].values())
    assert tried >= 20 and all(seen.values()), (tried, seen)


def test_a_token_counted_twice_fails_at_the_step_in_the_explorer(monkeypatch):
    """The token balance is a live check (stage/stats.py): a bookkeeping slip is an error where it
    happens, not a counter that disagrees after the run."""
    from pipespec_mpi.stage.stats import StageStats

    assert explore("pipespec-greedy", 0).ok
    committed = StageStats.committed
    monkeypatch.setattr(StageStats, "committed", lambda self, n, length: committed(self, n + (n > 1), length))
    found = explore("pipespec-greedy", 0)
    assert found.verdict == "error" and "tokens held" in found.detail, found
