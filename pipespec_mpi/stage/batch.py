"""Batched decoding on one stage: B sequences in flight (slots), their forwards run together.

A slot is one ``StageProcess`` over its own jobs, with its own stage loop, KV cache, epochs
header and proposal link (run/setup.py ``connect(..., slot=s)`` gives each slot its own window,
tagged channels and communicators): per sequence, the protocol is exactly the one-sequence
protocol the schedule explorer checks. What the slots share is the model:
``BatchedStage.step`` advances every live slot to its forward (``StageProcess.advance``), runs
the forwards it collected as one batched call (``score``: ``score_batch``, each backend's
requests through its ``score_many``: the weights read once for all rows), checks every slot's
logits under its rule at once (``check_all``: one batched accept, one host read) and hands each
slot its verdict (``complete``). A slot that waits (for its upstream, a gate, a handoff) costs the
others nothing: it is simply not in the batch.

Whatever the timing, a slot's iteration is the iteration ``StageLoop.step`` would make; only
when it happens changes, which the protocol already tolerates.

Under ``decode.policy=adaptive`` a slot never waits for more proposals while the others' forward
runs (``joining``): a row costs a fraction of a forward, and a slot that waits misses this
forward and joins the next one anyway; stepping now and verifying in the next forward what arrived
meanwhile commits at least as much (the step's token is the first proposal's, or the proposal
would have been rejected there). Joining keeps more slots in each forward (docs/notebook.md,
"Measurements behind the code's choices").

Under ``decode.policy=adaptive`` the slots' verifications share one budget of
``decode.batch_verify_rows`` rows per batched forward, given to the (slot, position) pairs most
likely to be committed (``goodput.allot_rows``), and only to those whose row pays for itself: the
stage fits its batched forwards' seconds as a line in their slots and verification rows
(``goodput.RowCost``), and a pair is taken only while it raises the forward's expected tokens
per second (its survival against the row's cost). A slot left with no rows takes a one-token
step of its own this time and keeps its proposals (the static policy caps each slot at
rows // B - 1). On CPUs, where each row is arithmetic, the budget alone let rows that did not
pay make batched PipeSpec slower than batched AR (docs/notebook.md, "Measurements behind the
code's choices").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch

from pipespec_mpi.speculative.goodput import RowCost, allot_rows
from pipespec_mpi.speculative.policy import Act, Cut
from pipespec_mpi.speculative.verifiers import check_all
from pipespec_mpi.stage.loop import Forward, Step
from pipespec_mpi.stage.ports import Clock, Scorer
from pipespec_mpi.stage.process import StageProcess, jobs_left
from pipespec_mpi.stage.prompt import Wait

# (scorer, seq, proposal) per forward -> logits [len(proposal)+1, V] per forward
ScoreBatch = Callable[[list[tuple[Scorer, list[int], list[int]]]], list[torch.Tensor]]


def score_batch(requests: list[tuple[Scorer, list[int], list[int]]]) -> list[torch.Tensor]:
    """``scorer.logits(seq, proposal)`` of every request: the requests of scorers sharing a
    backend (slots of one engine) through its ``score_many``, one call per backend."""
    groups: dict[int, list[int]] = {}
    backends: dict[int, Scorer] = {}
    for i, (scorer, _, _) in enumerate(requests):
        key = id(scorer.backend)
        groups.setdefault(key, []).append(i)
        backends.setdefault(key, scorer)
    out: list[torch.Tensor | None] = [None] * len(requests)
    for key, idx in groups.items():
        for i, rows in zip(idx, backends[key].score_many([requests[i] for i in idx]), strict=True):
            out[i] = rows
    return out  # type: ignore[return-value]


def score_alone(requests: list[tuple[Scorer, list[int], list[int]]]) -> list[torch.Tensor]:
    """One forward per request, whatever the backends could batch."""
    return [scorer.logits(seq, proposal) for scorer, seq, proposal in requests]


class BatchedStage:
    """One rank's stage over B slots; ``step()`` says DONE once every slot is done."""

    def __init__(
        self,
        slots: Sequence[StageProcess],
        clock: Clock,
        score: ScoreBatch = score_batch,
        held: Callable[[], AbstractContextManager[None]] = nullcontext,
    ) -> None:
        if not slots:
            raise ValueError("a batched stage needs at least one slot")
        self.slots = list(slots)
        self.clock, self.score = clock, score
        # the slots' bookkeeping before and after a forward, each in one block whose rings reach
        # every neighbour once (``Doorbell.held``)
        self.held = held
        self.done = [False] * len(self.slots)
        self.batches = 0  # batched forwards run
        self.rows = 0  # forwards in them
        self.row_cost = RowCost()  # seconds of a batched forward by its rows (adaptive)

    @property
    def jobs_done(self) -> int:
        return sum(p.jobs_done for p in self.slots)

    @property
    def jobs_left(self) -> int:
        return jobs_left(self.slots)

    def step(self) -> Step:
        forwards: list[tuple[StageProcess, Forward]] = []
        moved = False
        waiting: list[int] = []  # slots that chose to wait for more proposals
        with self.held():
            for i, slot in enumerate(self.slots):
                if self.done[i]:
                    continue
                s = slot.advance(joining=bool(forwards))
                moved |= self._took(i, s, forwards)
                if not isinstance(s, Forward) and slot.waits_for_upstream:
                    waiting.append(i)
            if forwards:  # the waits of slots decided before the first forward yield to it
                for i in waiting:
                    moved |= self._took(i, self.slots[i].advance(joining=True), forwards)
        if forwards:
            forwards = self._allot(forwards)
            t0 = self.clock.now()
            logits = self.score([(slot.loop.model, f.seq, f.proposal) for slot, f in forwards])
            rows = sum(len(f.proposal) + 1 for _, f in forwards)
            self.row_cost.observe(len(forwards), rows, self.clock.now() - t0)
            # every slot's verdict in one batched accept and one host read
            checked = check_all(
                [slot.loop.question(f, out) for (slot, f), out in zip(forwards, logits, strict=True)]
            )
            with self.held():
                for (slot, f), answer in zip(forwards, checked, strict=True):
                    slot.complete(f, answer, t0)
            self.batches += 1
            self.rows += len(forwards)
            return Step.ACTED
        if all(self.done):
            return Step.DONE
        return Step.PROGRESS if moved else Step.WAITING

    def _took(self, i: int, s: Step | Forward, forwards: list[tuple[StageProcess, Forward]]) -> bool:
        """Slot i's step ``s``: its forward joins ``forwards``; whether anything moved."""
        if isinstance(s, Forward):
            forwards.append((self.slots[i], s))
            return False
        if s is Step.DONE:
            self.done[i] = True
            return True
        return s is not Step.WAITING

    def _allot(self, forwards: list[tuple[StageProcess, Forward]]) -> list[tuple[StageProcess, Forward]]:
        """Adaptive: cut the slots' verifications to the shared row budget, by survival, and to the
        rows that pay for themselves."""
        loop = forwards[0][0].loop
        if not loop.policy.shares_rows or len(self.slots) < 2:
            return forwards
        surv = [
            slot.loop.policy.survivals(len(f.proposal)) if f.act is Act.VERIFY else [] for slot, f in forwards
        ]
        budget = loop.cfg.batch_verify_rows
        if budget is None:
            budget = sum(len(s) + 1 for s in surv)
        out = []
        for (slot, f), k in zip(forwards, allot_rows(surv, budget, self.row_cost.line()), strict=True):
            if f.act is Act.VERIFY and k < len(f.proposal):
                slot.loop.policy.observe(Cut())
                f = Forward(Act.VERIFY, f.seq, f.proposal[:k]) if k else Forward(Act.OWN, f.seq, [])
            out.append((slot, f))
        return out

    def wait(self) -> Wait:
        """The live slots' waits as one: the least announced, the earliest recheck."""
        return Wait.all([p.wait() for i, p in enumerate(self.slots) if not self.done[i]])

    def describe(self) -> str:
        live = [f"slot {i}: {p.describe()}" for i, p in enumerate(self.slots) if not self.done[i]]
        return "; ".join(live) or "every slot done"
