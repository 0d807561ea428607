"""Batched decoding (stage/batch.py ``score_batch``, the engine's ``score_many``): B sequences per
stage, their forwards run together. The per-sequence protocol is the explored one; these tests check what
batching adds: each slot gets its own logits (bitwise its own forward on the float32 flat-kernel
models), slots never mix, and the real models stay lossless under the explorer's schedules."""

from __future__ import annotations

import pytest
import torch

from pipespec_mpi.config import DecodeConfig
from pipespec_mpi.models.scorer import EngineScorer
from pipespec_mpi.simulate.explore import FAMILIES, Parts, Scenario, World, explore
from pipespec_mpi.speculative.policy import StaticPolicy
from pipespec_mpi.stage.batch import BatchedStage, score_alone, score_batch
from pipespec_mpi.stage.prompt import On, Wait

from ..models.cpu.test_plugins import BASES, engine_for, model_for, needs_kernel
from ..speculative.test_sampling_power import tiny_parts

BATCH = [f for f in FAMILIES if f.endswith("-batch")]


# ------------------------------------------------------------------------------ score_batch
def _scorers(base: str, n: int) -> tuple[list[EngineScorer], list[EngineScorer]]:
    """n scorers decoding alone, and n slots of one batched scorer, on equal weights."""
    alone = [engine_for(model_for(base)) for _ in range(n)]
    first = engine_for(model_for(base))
    return alone, [first] + [first.for_slot() for _ in range(n - 1)]


@needs_kernel
@pytest.mark.parametrize("base", list(BASES))
def test_score_batch_gives_every_slot_bitwise_its_own_forward(base):
    """Four sequences at different lengths, steps and verifications of every size mixed, more
    rows than one batched forward takes (packed into groups of at most 16): every slot's logits
    are bitwise those of the same calls on the sequence alone, and its cache ends where it would."""
    alone, slots = _scorers(base, 4)
    assert all(s.engine is slots[0].engine and s.slot != slots[0].slot for s in slots[1:])
    prompts = [[(5 * i + b) % 250 for i in range(n)] for b, n in enumerate((9, 23, 4, 15))]
    seqs = [list(p) for p in prompts]
    for a, s, p in zip(alone, slots, prompts, strict=True):
        a.prefill(p, room=64)
        s.prefill(p, room=64)
    rounds = [
        [[], [1], [], [2, 3]],
        [[4, 5, 6, 7, 8, 9, 10, 11], [], [12], [13, 14, 15, 16, 17, 18]],
        [[20], [21], [22], [23]],
        [[30, 31, 32, 33, 34, 35, 36, 37, 38], [39] * 8, [], [40]],
    ]
    for props in rounds:
        got = score_batch([(s, q, pr) for s, q, pr in zip(slots, seqs, props, strict=True)])
        for b, pr in enumerate(props):
            assert torch.equal(got[b], alone[b].logits(seqs[b], pr)), (base, b, pr)
            seqs[b].append(int(got[b][-1].argmax()))  # the next round's sequence: its bonus token
            for sc in (slots[b], alone[b]):
                sc.truncate(len(seqs[b]) - 1)
            assert slots[b].length == alone[b].length == len(seqs[b]) - 1


def test_score_batch_asks_each_backend_once_for_its_requests_in_order():
    """Requests are grouped by their scorers' backend, each group through one ``score_many``,
    and every request gets its own rows back in the order asked."""
    calls = []

    class Fixed:
        def __init__(self, backend: str) -> None:
            self.backend = backend

        def score_many(self, requests):
            calls.append([len(seq) for _, seq, _ in requests])
            return [torch.full((len(p) + 1, 3), float(len(seq))) for _, seq, p in requests]

    a, b = Fixed("a"), Fixed("b")
    got = score_batch([(a, [1, 2], [3]), (b, [1], []), (a, [1, 2, 3], [])])
    assert calls == [[2, 3], [1]]
    assert [g.shape for g in got] == [(2, 3), (1, 3), (1, 3)]
    assert [g[0, 0].item() for g in got] == [2, 1, 3]


# ------------------------------------------------------------------------------ under the explorer
def test_the_batch_families_run_clean_and_really_batch():
    """A slice of every "-batch" family: lossless, counters add up, and forwards of several slots
    did run together."""
    multi = 0
    for family in BATCH:
        for seed in range(12):
            world = World(Scenario.draw(family, seed))
            found = world.run()
            assert found.ok, found
            multi += sum(p.rows - p.batches for p in world.procs if isinstance(p, BatchedStage))
    assert multi > 0


def crossed(requests):
    """A broken batch: every slot gets the next slot's logits."""
    out = score_alone(requests)
    return out[1:] + out[:1] if len(out) > 1 else out


@pytest.mark.parametrize("family", ["pipespec-greedy-batch", "sd-greedy-batch"])
def test_slots_getting_each_others_logits_is_caught(family):
    caught = 0
    for seed in range(10):
        world = World(Scenario.draw(family, seed))
        found = World(
            world.sc, Parts(world.parts.model, world.parts.prompts, world.parts.eos, score=crossed)
        ).run()
        caught += found.verdict in ("mismatch", "error", "counter")
    assert caught >= 5, caught


@pytest.mark.slow
@pytest.mark.parametrize("family", ["pipespec-greedy-batch", "sd-greedy-batch"])
def test_the_real_tiny_models_batched_stay_lossless_under_adversarial_schedules(family):
    """The tiny hierarchy's models, every slot a ``for_slot`` of one scorer per stage and the
    forwards through ``score_batch``: greedy output equals the target alone under the schedules."""
    base = tiny_parts()
    shared = {}

    def model(i: int) -> EngineScorer:
        if i not in shared:
            shared[i] = base.model(i)
            return shared[i]
        return shared[i].for_slot()

    for seed in range(3):
        shared.clear()
        sc = Scenario.draw(family, seed, k=3, lookup=False, n_prompts=3, slots=3, stop_before=None,
                           decode=DecodeConfig(lookahead=seed % 3, sd_window=2, max_run_ahead=4,
                                               max_new_tokens=10))  # fmt: skip
        prompts = [base.prompts[0][: 3 + j] for j in range(3)]
        world = World(sc, Parts(model, prompts, base.eos, score=score_batch))
        found = world.run()
        assert found.ok, found
        assert sum(p.rows - p.batches for p in world.procs) > 0


def test_a_batched_stage_gives_out_only_the_rows_that_pay():
    """Adaptive: until its forwards showed what a row costs, the slots share the row budget by
    survival alone; then a position is verified only while its row raises the forward's expected
    tokens per second (``goodput.allot_rows``), and a slot left with none steps alone, its
    proposal kept."""
    from types import SimpleNamespace

    from pipespec_mpi.speculative.goodput import Estimates
    from pipespec_mpi.speculative.policy import Act, AdaptivePolicy
    from pipespec_mpi.stage.loop import Forward

    cfg = DecodeConfig(policy="adaptive", batch_verify_rows=16)

    def slot(accept: float) -> SimpleNamespace:
        policy = AdaptivePolicy(cfg, lambda: 0.0, Estimates(accept, 0.1))
        loop = SimpleNamespace(policy=policy, cfg=cfg)
        return SimpleNamespace(loop=loop)

    good, poor, worse = slot(0.9), slot(0.5), slot(0.2)
    stage = BatchedStage([good, poor, worse], clock=SimpleNamespace(now=lambda: 0.0))
    asked = [(sl, Forward(Act.VERIFY, [1, 2], [5, 6, 7, 8])) for sl in (good, poor, worse)]
    assert [len(f.proposal) for _, f in stage._allot(asked)] == [4, 4, 4]  # 15 rows: within 16
    for b in range(1, 4):  # 12 ms + 3 ms a slot + 1 ms a verification row
        for e in range(11):
            stage.row_cost.observe(b, b + e, 0.012 + 0.003 * b + 0.001 * e)
    # three slots: 3 tokens in 21 ms; good's four rows and poor's first (0.5) raise the rate,
    # poor's second (0.25) would not (6.6 tokens in 26 ms: a 1 ms row must survive 0.254)
    got = stage._allot(asked)
    assert [(f.act, len(f.proposal)) for _, f in got] == [(Act.VERIFY, 4), (Act.VERIFY, 1), (Act.OWN, 0)]
    assert [sl.loop.policy.report()[0].verify_cut for sl in (good, poor, worse)] == [0, 1, 1]
    assert [len(f.proposal) for _, f in asked] == [4, 4, 4]  # the slots' own forwards untouched


def test_explore_names_the_batch_families():
    assert len(BATCH) == 6 and explore("pipespec-greedy-batch", 1).ok


def test_a_batched_stage_waits_on_the_least_announced_of_its_live_slots_waits():
    """A batched stage's ``Wait``: on a neighbour only when every slot still decoding is (a slot
    at the deal, a start gate or a handoff waits on a collective; a slot owing a send on something
    no ring announces); ``until``: the earliest of theirs."""
    from types import SimpleNamespace

    def slot(on: On, at: float | None) -> SimpleNamespace:
        return SimpleNamespace(wait=lambda: Wait(on, at))

    slots = [slot(On.NEIGHBOUR, None), slot(On.NEIGHBOUR, 3.0), slot(On.COLLECTIVE, 1.0)]
    stage = BatchedStage([*slots, slot(On.OTHER, None)], clock=SimpleNamespace(now=lambda: 0))
    assert stage.wait() == Wait(On.OTHER, 1.0)
    stage.done[3] = True  # a finished slot waits for nothing
    assert stage.wait() == Wait(On.COLLECTIVE, 1.0)
    stage.done[2] = True
    assert stage.wait() == Wait(On.NEIGHBOUR, 3.0)


def test_a_stage_loop_owing_a_send_waits_on_what_no_ring_announces():
    """Tokens owed that a send buffer has no room for yet: a ring alone does not move it."""
    from types import SimpleNamespace

    from pipespec_mpi.stage.loop import StageLoop
    from pipespec_mpi.stage.outbox import Outbox

    owing = SimpleNamespace(p=SimpleNamespace(outbox=Outbox(0, sender=object()), out=[7, 8]), until=2.0)
    owing.p.outbox.sent = 1
    assert StageLoop.wait(owing) == Wait(On.OTHER, 2.0)
    owing.p.outbox.sent = 2
    assert StageLoop.wait(owing) == Wait(On.NEIGHBOUR, 2.0)
    free = SimpleNamespace(p=SimpleNamespace(outbox=Outbox(0, sender=None), out=[7, 8]), until=None)
    assert StageLoop.wait(free) == Wait(On.NEIGHBOUR)


def test_a_stage_process_waits_on_its_replicas_collective_between_its_prompts():
    from types import SimpleNamespace

    from pipespec_mpi.stage.process import StageProcess

    def proc(phase: str) -> StageProcess:
        p = StageProcess.__new__(StageProcess)  # the phase and the loop are all wait() reads
        p.phase, p.loop = phase, SimpleNamespace(wait=lambda: Wait(On.NEIGHBOUR, 5.0))
        return p

    assert {proc(ph).wait() for ph in ("deal", "gate", "handoff")} == {Wait(On.COLLECTIVE)}
    assert proc("decode").wait() == Wait(On.NEIGHBOUR, 5.0)
    assert proc("next").wait() == Wait(On.OTHER)


def test_a_batched_stages_bookkeeping_rings_once_per_block_and_its_forward_never_waits_for_one():
    """The slots' advances and their completions each run in one ``held`` block (rings reach
    each neighbour once, as the block ends: ``Doorbell.held``); the forward runs between them,
    so no ring waits for it."""
    from contextlib import contextmanager
    from types import SimpleNamespace

    from pipespec_mpi.speculative.policy import Act
    from pipespec_mpi.speculative.verifiers import Greedy, Question
    from pipespec_mpi.stage.loop import Forward

    depth, log = [0], []

    @contextmanager
    def held():
        depth[0] += 1
        log.append("open")
        try:
            yield
        finally:
            depth[0] -= 1
            log.append("close")

    def slot(i: int) -> SimpleNamespace:
        def advance(joining: bool) -> Forward:
            log.append(f"advance {i} held={depth[0]}")
            return Forward(Act.OWN, [1, 2], [])

        def complete(f, rows, t0) -> None:
            log.append(f"complete {i} held={depth[0]}")

        def question(f, rows) -> Question:
            log.append(f"question {i} held={depth[0]}")
            return Question(Greedy(), f.proposal, rows, 0)

        loop = SimpleNamespace(policy=StaticPolicy(DecodeConfig()), model=None, question=question)
        return SimpleNamespace(advance=advance, complete=complete, waits_for_upstream=False, loop=loop)

    def score(requests):
        log.append(f"forward held={depth[0]}")
        return [torch.zeros(1, 4) for _ in requests]

    stage = BatchedStage([slot(0), slot(1)], clock=SimpleNamespace(now=lambda: 0.0), score=score, held=held)
    stage.step()
    assert log == [
        "open", "advance 0 held=1", "advance 1 held=1", "close",
        "forward held=0", "question 0 held=0", "question 1 held=0",
        "open", "complete 0 held=1", "complete 1 held=1", "close",
    ]  # fmt: skip


@pytest.mark.parametrize("family", ["pipespec-greedy-batch", "pipespec-gumbel-batch"])
def test_a_batched_step_reads_the_host_once(family, monkeypatch):
    """The tiny models' slots batched under the explorer's schedules: a step that ran a batched
    forward read its device's values once (every slot's verdict together), and a step without
    one never; the forward's own reads (the model's) are not counted. Outputs stay lossless."""
    from host_reads import HostReads

    base = tiny_parts()
    shared: dict[int, EngineScorer] = {}
    reads = HostReads()
    per_step: list[tuple[int, int]] = []  # (forwards run, host reads) of each step

    def model(i: int) -> EngineScorer:
        if i not in shared:
            shared[i] = base.model(i)
            return shared[i]
        return shared[i].for_slot()

    def score(requests):
        reads.paused = True
        try:
            return score_batch(requests)
        finally:
            reads.paused = False

    step = BatchedStage.step

    def counted(self):
        before, reads.count = self.batches, 0
        with reads:
            s = step(self)
        per_step.append((self.batches - before, reads.count))
        return s

    monkeypatch.setattr(BatchedStage, "step", counted)
    sc = Scenario.draw(family, 1, k=3, lookup=False, n_prompts=3, slots=3, stop_before=None,
                       decode=DecodeConfig(lookahead=1, max_new_tokens=8))  # fmt: skip
    found = World(sc, Parts(model, [base.prompts[0][: 3 + j] for j in range(3)], base.eos, score=score)).run()
    assert found.ok, found
    assert sum(f for f, _ in per_step) > 0
    assert all(r == f for f, r in per_step), [x for x in per_step if x[0] != x[1]][:5]
