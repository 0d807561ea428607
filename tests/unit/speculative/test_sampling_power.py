"""The statistical test of sampling must be able to fail. The real stage loop samples in-process:
tiny models, the schedule explorer's ports and schedules (simulate/explore/), the same prompt as
the MPI sampling tests. The chi-square test accepts the Leviathan verifier and rejects a verifier
that accepts every proposal, which the test passes in (``AcceptAll``): under the static policy at
batch 1, and under the adaptive policy with four slots per stage."""

from __future__ import annotations

import pytest
from sampling_stats import EOS, PROMPT_IDS, N, chi_square, exact_joint

from pipespec_mpi.config import DecodeConfig, compose_config
from pipespec_mpi.models.loader import load_stage
from pipespec_mpi.models.scorer import EngineScorer
from pipespec_mpi.simulate.explore import Parts, Scenario, World
from pipespec_mpi.speculative.verifiers import AcceptAll

pytestmark = pytest.mark.slow


def tiny_parts(wrap=None) -> Parts:
    """The tiny hierarchy's three models (weights built once, a fresh KV cache per call)."""
    hier = compose_config(["hierarchy=tiny"]).hierarchy
    scorers = [load_stage(hier, i, []) for i in range(hier.n_stages)]

    def model(i: int) -> EngineScorer:
        return scorers[i].for_slot()

    return Parts(model, [list(PROMPT_IDS)] * N, EOS, wrap)


def samples(coupling: str, broken: bool) -> list[tuple]:
    # a random schedule of a brisk pipeline (the adversarial ones are the explorer's own runs)
    sc = Scenario.draw(f"pipespec-{coupling}", 7, k=3, lookup=False, n_prompts=N, top_k=4,
                       decode=DecodeConfig(lookahead=2, max_new_tokens=2, policy="static"), gate_delay=0,
                       handoff_delay=0, p_deliver=1.0, starve=False, bursts=False,
                       stop_before=None)  # fmt: skip
    world = World(sc, tiny_parts(AcceptAll if broken else None))
    found = world.run()
    assert found.verdict in (("ok", "mismatch") if broken else ("ok",)), found
    assert sum(world.outcomes[(j.seq, 2)].stats.tokens_accepted for j in world.jobs) > 0
    return [tuple(out[:2]) for out in world.outputs()]


@pytest.mark.parametrize("coupling,broken", [("leviathan", False), ("leviathan", True), ("gumbel", True)])
def test_chi_square_accepts_the_verifier_and_rejects_an_always_accepting_one(coupling, broken):
    stat, crit = chi_square(samples(coupling, broken), exact_joint(1.0, 4, 1.0))
    if broken:
        assert stat > crit, f"broken verifier not detected: chi2 {stat:.1f} < {crit:.1f}"
    else:
        assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f}: samples do not follow the target"


def adaptive_batched_samples(broken: bool) -> tuple[list[tuple], int]:
    """The adaptive policy, four slots per stage, its clocks drawn (the explorer's DriftClock): the
    upstream stages stepped three times as often as the target, so that the target's slots find
    proposals pending and verify them, cut by its fitted row costs. Under real mpirun the tiny
    stages cost about the same, and whether the target ever has a proposal pending follows the
    timing (one CI run at 00a1fbd verified none in 400 samples); here the schedule is the seed's.
    Returns the samples and how many tokens the target accepted."""
    sc = Scenario.draw("pipespec-leviathan-adaptive", 8, k=3, lookup=False, suffix=False, n_prompts=N,
                       top_k=4, decode=DecodeConfig(max_new_tokens=2, policy="adaptive"), slots=4,
                       chaos=False, speeds=(3.0, 3.0, 1.0), gate_delay=0, handoff_delay=0, p_deliver=1.0,
                       starve=False, bursts=False, stop_before=None, budgets=(),
                       drafter_survival=0.0)  # fmt: skip
    world = World(sc, tiny_parts(AcceptAll if broken else None))
    found = world.run()
    assert found.verdict in (("ok", "mismatch") if broken else ("ok",)), found
    accepted = sum(world.outcomes[(j.seq, 2)].stats.tokens_accepted for j in world.jobs)
    return [tuple(out[:2]) for out in world.outputs()], accepted


@pytest.mark.parametrize("broken", [False, True])
def test_adaptive_batched_sampling_follows_the_target_and_a_broken_verifier_is_caught(broken):
    pairs, accepted = adaptive_batched_samples(broken)
    assert accepted >= N // 4  # the target's verifications decided a good share of the samples
    stat, crit = chi_square(pairs, exact_joint(1.0, 4, 1.0))
    if broken:
        assert stat > crit, f"broken verifier not detected: chi2 {stat:.1f} < {crit:.1f}"
    else:
        assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f}: samples do not follow the target"
