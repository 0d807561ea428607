"""A stage's life over a list of jobs, as one steppable object, and the driver that runs it on a rank.

For every job: learn which job is next (stage/deal.py: in turn, or from a queue the slots share),
reset the stage's header for the prompt, pass the replica's start gate, decode (``StageLoop.step()``
until DONE), hand the outcome over (stats to the replica's leader), next job.
The gate is also where the replica agrees to stop early (run/drain.py): then no stage starts the
job, and ``jobs_left`` says how many were not started.
While it waits at the gate or for the handoff it keeps taking in proposals (an upstream that passed
the gate first may already send for the new prompt) and keeps its heartbeat fresh.

The gate and the handoff are ports: MPI (run/collect.py: a non-blocking barrier, stats sent to the
leader) or the schedule explorer's (simulate/explore/: released and delivered when its schedule
says). ``drive`` runs any steppable on a real clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from pipespec_mpi.speculative.verifiers import Verifier
from pipespec_mpi.stage.deal import END, Deal, InTurn
from pipespec_mpi.stage.loop import Forward, StageLoop, Step
from pipespec_mpi.stage.stats import StageOutcome
from pipespec_mpi.stage.wait import Backoff, StallError


class Job(Protocol):
    seq: int  # increasing over a replica's jobs: what headers and messages are tagged with
    prompt_ids: list[int]
    method: str
    max_new_tokens: int | None  # the prompt's own budget (None: the stage's decode.max_new_tokens)
    store_key: str  # the drafter's job store it drafts from and joins (models/suffix.py)


class Gate(Protocol):
    def open(self, seq: int) -> None:
        """This stage has reset its header for prompt ``seq`` and is ready to start it."""

    def passed(self) -> bool:
        """Every stage of the replica is ready (never blocks)."""

    def stopped(self) -> bool:
        """After ``passed``: the replica agreed to stop before this job (every stage sees the
        same answer), so no stage starts it."""


class Handoff(Protocol):
    def post(self, job: Job, outcome: StageOutcome) -> None:
        """Hand over this stage's outcome of ``job`` (never blocks)."""

    def delivered(self) -> bool:
        """The outcome has been taken (the leader: every stage's outcome has arrived)."""


class Steppable(Protocol):
    def step(self) -> Step: ...

    def describe(self) -> str: ...

    def rung(self) -> bool:
        """Everything its last WAITING step waits for rings its rank's bell (comm/doorbell.py):
        a neighbour's publish or proposal, or its own ``recheck_at``."""

    def patient(self) -> bool:
        """After a WAITING iteration that is not ``rung``: whatever it waits for is at most a
        collective of its replica away, whose other stages ring it when they join (the deal,
        the start gate, the handoff); its driver may sleep up to ``QUIET_S`` between polls."""

    @property
    def recheck_at(self) -> float | None:
        """When to step again although no neighbour rang (the stage clock), None: only when rung."""


class Bell(Protocol):
    covers: bool  # every neighbour's change rings it by the time the change is visible

    def wait(self, timeout_s: float) -> bool:
        """Sleep until rung or ``timeout_s`` passed; take the rings."""


class StageProcess:
    """One rank's stage over its jobs; ``step()`` says DONE once every job it was dealt is handed
    over. ``jobs``: the phase's jobs; ``deal``: which of them this slot decodes (default: all of
    them, in order)."""

    def __init__(
        self,
        loop: StageLoop,
        gate: Gate,
        handoff: Handoff,
        jobs: Sequence[Job],
        verifier_for: Callable[[Job], Verifier],
        on_start: Callable[[Job], None] | None = None,
        deal: Deal | None = None,
        collectives_ring: bool = False,
    ) -> None:
        self.loop, self.gate, self.handoff = loop, gate, handoff
        # every other stage of the replica rings this rank when it joins the deal, the gate or
        # the handoff (comm/doorbell.py RingingGate, RingingDeal, RingingHandoff): waits there
        # may sleep longer
        self.collectives_ring = collectives_ring
        self.jobs, self.verifier_for, self.on_start = list(jobs), verifier_for, on_start
        self.deal = deal if deal is not None else InTurn(len(self.jobs))
        self.index = -1
        self.phase = "next"  # next | deal | gate | decode | handoff | end
        self.stopped = False  # the replica agreed to stop before this slot's job
        self.jobs_started = 0
        self.jobs_done = 0  # jobs handed over

    @property
    def job(self) -> Job | None:
        return self.jobs[self.index] if 0 <= self.index < len(self.jobs) else None

    @property
    def jobs_left(self) -> int:
        """Jobs of the phase not started because the replica stopped early (0 if it did not);
        for a batched stage: ``jobs_left(slots)``."""
        return jobs_left([self])

    def step(self) -> Step:
        """One step, its forward (if any) run alone."""
        s = self.advance()
        return self.loop.run_forward(s) if isinstance(s, Forward) else s

    def advance(self, joining: bool = False) -> Step | Forward:
        """One step up to the stage loop's forward (``StageLoop.advance``, ``joining`` passed
        to it), which the driver runs and hands to ``complete``."""
        if self.phase == "next":
            self.deal.open()
            self.phase = "deal"
        if self.phase == "deal":
            got = self.deal.dealt()
            if got is None:
                self.loop.pump()
                return Step.WAITING
            if got == END:
                self.phase = "end"
                return Step.DONE
            self.index = got
            self.loop.reset(self.job.seq)
            self.gate.open(self.job.seq)
            self.phase = "gate"
            return Step.PROGRESS
        if self.phase == "gate":
            self.loop.pump()
            if not self.gate.passed():
                return Step.WAITING
            if self.gate.stopped():
                self.stopped = True
                self.phase = "end"
                return Step.DONE
            self.jobs_started += 1
            if self.on_start is not None:
                self.on_start(self.job)
            job = self.job
            self.loop.begin(
                job.prompt_ids, job.method, self.verifier_for(job), job.max_new_tokens, job.store_key
            )
            self.phase = "decode"
            return Step.PROGRESS
        if self.phase == "decode":
            s = self.loop.advance(joining)
            if s is not Step.DONE:
                return s
            self.handoff.post(self.job, self.loop.finish())
            self.phase = "handoff"
            return Step.PROGRESS
        if self.phase == "handoff":
            self.loop.pump()
            if not self.handoff.delivered():
                return Step.WAITING
            self.jobs_done += 1
            self.phase = "next"
            return Step.PROGRESS
        return Step.DONE

    def complete(self, fwd: Forward, logits: torch.Tensor, t0: float) -> Step:
        return self.loop.complete(fwd, logits, t0)

    def rung(self) -> bool:
        """Decoding, nothing left unsent: only a neighbour or its policy's recheck moves it (the
        start gate, the deal and the handoff are MPI collectives: a ring there says a member
        joined, not that the collective completed; see ``patient``)."""
        return self.phase == "decode" and self.loop.rung()

    def patient(self) -> bool:
        """Rung, or waiting for a collective whose other stages ring when they join."""
        return self.rung() or (self.collectives_ring and self.phase in ("deal", "gate", "handoff"))

    @property
    def recheck_at(self) -> float | None:
        return self.loop.recheck_at if self.phase == "decode" else None

    @property
    def waits_for_upstream(self) -> bool:
        """Its last step waited for more proposals by choice (``StageLoop.advance``)."""
        return self.phase == "decode" and self.loop.waits_for_upstream

    def describe(self) -> str:
        r = self.loop.role
        where = {
            "deal": "waiting to be dealt its next job, after",
            "gate": "at the start gate of",
            "decode": "decoding",
            "handoff": "handing over the outcome of",
        }.get(self.phase, self.phase)
        seq = f" job {self.job.seq}" if self.job is not None else (" none" if self.phase == "deal" else "")
        return f"stage {r.stage} (rank {r.rank}) {where}{seq}"


def jobs_left(slots: Sequence[StageProcess]) -> int:
    """Jobs of a phase its slots did not start because the replica stopped early: every job not
    started once any slot was stopped (a stop is agreed by all stages of a slot, and a stopped
    slot takes no more jobs), else none."""
    if not any(p.stopped for p in slots):
        return 0
    return len(slots[0].jobs) - sum(p.jobs_started for p in slots)


# How long a waiting stage whose bell covers it sleeps at most without a ring: a safety net only
# (a ring is never lost, comm/doorbell.py), short enough that a missed one costs a fraction of a
# forward, long enough that the wake-ups cost nothing (a four-slot step: about 0.1 ms). Also the
# longest backoff sleep at a collective whose members ring: polled every millisecond, the
# suffix drafter's 16 slots waiting at the deal through a batched AR phase (it has no part in AR
# jobs) took 8.6% of a core from a target computing on both cores of a 2-core node.
QUIET_S = 0.01
# ... and where a waiting step costs more (a step over many slots), longer, up to QUIET_MAX_S, so
# that the safety net's wake-ups take at most QUIET_SHARE of a core: a two-stage job's suffix
# drafter over 16 slots woke 816 times in one batch-16 phase at the 10 ms limit, for 931 waits
# without a ring and 224 with one, each wake a step of all 16 slots (news, 2-core Xeon with AMX,
# 2026-12-05), inside the target's two-thread forwards.
QUIET_MAX_S = 0.1
QUIET_SHARE = 0.01


def drive(
    stepper: Steppable,
    stall_timeout_s: float,
    bell: Bell | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> None:
    """Step until DONE on a real clock: again at once after progress; while waiting, asleep until
    a neighbour rings ``bell`` (or the stepper's own ``recheck_at``, or the quiet limit:
    ``quiet_limit``) where the bell covers what it waits for; at a collective whose other stages
    ring when they join (``patient``), backoff sleeps up to the quiet limit, started again by
    every ring (a collective completes only as its members poll it, so a ring says: poll soon);
    elsewhere backoff sleeps of 20 us doubling to 1 ms, cut short by a ring; never spinning.
    ``StallError`` once nothing has moved for ``stall_timeout_s``. ``clock``: the stage clock
    ``recheck_at`` is on, and its waiting steps' cost (``quiet_limit``)."""
    backoff = Backoff()
    last = time.monotonic()
    cost = 0.0  # a waiting step's seconds (exponential average)
    while True:
        t0 = clock()
        if (s := stepper.step()) is Step.DONE:
            return
        if s is not Step.WAITING:
            backoff.reset()
            last = time.monotonic()
            continue
        cost += 0.2 * (clock() - t0 - cost)
        if time.monotonic() - last > stall_timeout_s:
            raise StallError(f"{stepper.describe()}: no progress for {stall_timeout_s:.0f} s")
        quiet = quiet_limit(cost)
        if bell is None:
            backoff.sleep()
        elif bell.covers and stepper.rung():
            bell.wait(_until_recheck(stepper, quiet, clock))
        elif bell.covers and stepper.patient():
            if bell.wait(_until_recheck(stepper, backoff.take(quiet), clock)):
                backoff.reset()
        else:
            bell.wait(backoff.take())


def quiet_limit(step_s: float) -> float:
    """The longest sleep without a ring after waiting steps of ``step_s`` seconds each: QUIET_S,
    or as long as keeps their wake-ups within QUIET_SHARE of a core, at most QUIET_MAX_S."""
    return min(QUIET_MAX_S, max(QUIET_S, step_s / QUIET_SHARE))


def _until_recheck(stepper: Steppable, timeout_s: float, clock: Callable[[], float]) -> float:
    """``timeout_s``, cut to the stepper's ``recheck_at``."""
    at = stepper.recheck_at
    return timeout_s if at is None else min(timeout_s, max(0.0, at - clock()))
