"""A stage's life over a list of jobs, as one steppable object.

For every job: learn which job is next (stage/deal.py: in turn, or from a queue the slots share),
reset the stage's header for the prompt, pass the replica's start gate, decode (``StageLoop.step()``
until DONE), hand the outcome over (stats to the replica's leader), next job.
The gate is also where the replica agrees to stop early (run/drain.py): then no stage starts the
job, and ``jobs_left`` says how many were not started.
While it waits at the gate or for the handoff it keeps taking in proposals (an upstream that passed
the gate first may already send for the new prompt) and keeps its heartbeat fresh.

The gate and the handoff are ports: MPI (run/collect.py: a non-blocking barrier, stats sent to the
leader) or the schedule explorer's (simulate/explore/: released and delivered when its schedule
says). What drives a steppable on a rank, and how it waits, is run/drive.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from pipespec_mpi.speculative.verifiers import Checked, Verifier
from pipespec_mpi.stage.deal import END, Deal, InTurn
from pipespec_mpi.stage.loop import Forward, StageLoop, Step
from pipespec_mpi.stage.prompt import On, Wait
from pipespec_mpi.stage.stats import StageOutcome


class Job(Protocol):
    seq: int  # increasing over a replica's jobs: what headers and messages are tagged with
    prompt_ids: list[int]
    method: str
    max_new_tokens: int | None  # the prompt's own budget (None: the stage's decode.max_new_tokens)
    store_key: str  # the drafter's job store it drafts from and joins (models/suffix.py)

    def runs_on(self, stage: int) -> bool:
        """Whether ``stage`` decodes it (a route's job: the others sit it out)."""


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

    def wait(self) -> Wait:
        """After a WAITING step: what it waits on (stage/prompt.py)."""


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
    ) -> None:
        self.loop, self.gate, self.handoff = loop, gate, handoff
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
                job.prompt_ids, job.method, self.verifier_for(job), job.max_new_tokens, job.store_key,
                idle=not job.runs_on(self.loop.role.stage),
            )  # fmt: skip
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

    def complete(self, fwd: Forward, checked: Checked, t0: float) -> Step:
        return self.loop.complete(fwd, checked, t0)

    def wait(self) -> Wait:
        """Decoding: the stage loop's wait; at the deal, the start gate or the handoff: the
        replica's collective."""
        if self.phase == "decode":
            return self.loop.wait()
        return Wait(On.COLLECTIVE if self.phase in ("deal", "gate", "handoff") else On.OTHER)

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
