"""The online plan in a job (``method=online``): the replica's leader picks each prompt's plan
(run/online.py ``OnlinePlan``, one per batch size), every stage of the replica learns it from a
non-blocking broadcast, the prompt runs on it, and the leader notes what it measured. At the
end the leader logs what it ran and why, writes ``online.json`` and leaves its estimates to the
next job (``PlanMemory``)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import numpy as np

from pipespec_mpi.config import AppConfig
from pipespec_mpi.run.jobs import Job
from pipespec_mpi.run.online import Arm, OnlinePlan, fixed, plans
from pipespec_mpi.topology import Placement

log = logging.getLogger("pipespec_mpi")

ONLINE = "online.json"


class PlanMemory(Protocol):
    """Where the online plan's estimates outlive the job (plan/memory.py: the node's cache)."""

    def load(self, batch_size: int) -> dict[str, float] | None:
        """The estimates (ms per token by plan name) an earlier job left, or None."""

    def save(self, batch_size: int, estimates: dict[str, float]) -> None: ...


WaitFor = Callable[[Callable[[], bool], str], None]  # wait(done, what): until done(), pumping the loops


class OnlineDecisions:
    """The runner's side of the online plan for one rank (every stage: ``split``, ``agree``; the
    leader also picks, observes and reports)."""

    def __init__(self, cfg: AppConfig, pl: Placement, memory: PlanMemory | None = None) -> None:
        self.cfg, self.pl, self.memory = cfg, pl, memory
        self.arms = plans(cfg)
        whole = Arm("pipespec", tuple(range(cfg.hierarchy.n_stages)))
        self.choices = list(dict.fromkeys([*self.arms, whole]))  # what a broadcast index names
        self.bandits: dict[int, OnlinePlan] = {}  # the leader's, per batch size
        self.pending: tuple[int, Arm] | None = None  # the leader's last pick, to observe

    def split(self, group: list[Job]) -> list[list[Job]]:
        """A phase's jobs in the parts that each run on one plan: an online job alone at batch 1
        (the jobs of other methods between them together), ``online.chunk`` * B of them batched."""
        if not any(job.method == "online" for job in group):
            return [group]
        size = group[0].batch_size
        if size > 1:
            n = self.cfg.online.chunk * size
            return [group[i : i + n] for i in range(0, len(group), n)]
        parts: list[list[Job]] = []
        for job in group:
            if job.method == "online" or not parts or parts[-1][0].method == "online":
                parts.append([])
            parts[-1].append(job)
        return parts

    def agree(self, part: list[Job], comm, wait: WaitFor) -> list[Job]:
        """``part``'s jobs on the plan the leader picks (a collective of the replica's stages)."""
        leader = self.pl.n_stages - 1  # the leader's rank in the replica's communicator
        buf = np.zeros(1, dtype=np.int64)
        note = None
        if self.pl.is_last:
            arm, note = self._pick(part)
            buf[0] = self.choices.index(arm)
        req = comm.Ibcast(buf, root=leader)
        wait(req.Test, f"the plan of job {part[0].seq}")
        arm = self.choices[int(buf[0])]
        return [
            replace(job, method=arm.method, route=arm.route, plan=arm.name, plan_note=note) for job in part
        ]

    def observe(self, part: list[Job], tokens: int, seconds: float) -> None:
        """The leader: what the plan just run measured (``tokens`` in ``seconds``, start to handoff)."""
        if self.pending is not None and part[0].online:
            size, arm = self.pending
            self.bandits[size].observe(arm, tokens, seconds)
        self.pending = None

    def close(self, run_dir: Path) -> None:
        """The leader of replica 0: what the plan did, in the log and ``online.json``; its estimates
        left to the next job."""
        if not self.bandits or not self.pl.is_last:
            return
        report = {}
        for size, bandit in sorted(self.bandits.items()):
            report[str(size)] = summary = bandit.summary()
            log.info("online plan (batch %d): %s", size, describe(summary))
            if self.memory is not None:
                self.memory.save(size, bandit.estimates())
        if self.pl.replica == 0:
            (run_dir / ONLINE).write_text(json.dumps(report, indent=1) + "\n")

    def _pick(self, part: list[Job]) -> tuple[Arm, str]:
        """The leader's pick for ``part``: the fixed plan of a warm-up or of a prompt sampled by
        Leviathan's rule (``fixed``), else its batch size's bandit's."""
        if part[0].warmup:
            return self.arms[0], "warm-up"
        for job in part:
            arm = fixed(self.cfg, job.prompt.sampling(self.cfg.sampling))
            if arm is not None:
                return arm, "Leviathan sampling: its tokens depend on the verifying stages"
        size = part[0].batch_size
        if size not in self.bandits:
            prior = self.memory.load(size) if self.memory is not None else None
            self.bandits[size] = OnlinePlan(self.arms, self.cfg.online, prior)
        got = self.bandits[size].pick()
        self.pending = (size, got.arm)
        return got.arm, got.why


def describe(summary: dict) -> str:
    """One line: the plan it ended on, prompts per plan, each plan's estimate, the switches."""
    runs = ", ".join(f"{name} {n}" for name, n in summary["runs"].items() if n)
    est = ", ".join(
        f"{name} {ms:.2f}" for name, ms in sorted(summary["ms_per_token"].items(), key=lambda x: x[1])
    )
    switches = len(summary["switches"])
    current = summary["current"] or "none yet (still exploring)"
    return (
        f"ended on {current}; prompts per plan: {runs}; measured ms/token: {est}; "
        f"{switches} switch{'es' if switches != 1 else ''}"
    )
