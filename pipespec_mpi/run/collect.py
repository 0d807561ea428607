"""The MPI ends of a job (the ports ``StageProcess`` drives): the deal, the start gate, the handoff of every
stage's stats to the replica's leader (its last stage), and what the leader does with them: one
``Record`` assembled and appended to ``parts/replica-<r>.jsonl``, flushed and fsynced."""

from __future__ import annotations

import logging
import os
import resource
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from pipespec_mpi.config import AppConfig
from pipespec_mpi.config.schema import Policy
from pipespec_mpi.records import Record, drop_torn_tail
from pipespec_mpi.run.jobs import Job
from pipespec_mpi.stage.deal import END, JobQueue
from pipespec_mpi.stage.stats import StageOutcome, StageStats
from pipespec_mpi.topology import Placement

if TYPE_CHECKING:
    from pipespec_mpi.host.placement import CpuPlacement

STATS_TAG = 11
log = logging.getLogger("pipespec_mpi")


def part_path(run_dir: Path, replica: int) -> Path:
    return run_dir / "parts" / f"replica-{replica}.jsonl"


class MaxVote:
    """One int from every stage of a slot, reduced to their maximum without blocking (an
    Iallreduce, MAX): the start gate's and the deal's collective."""

    def __init__(self, comm) -> None:
        import numpy as np
        from mpi4py import MPI

        self._MAX = MPI.MAX
        self.comm = comm
        self.mine = np.zeros(1, dtype=np.int64)
        self.result = np.zeros(1, dtype=np.int64)
        self.req = None

    def start(self, value: int) -> None:
        self.mine[0] = value
        self.req = self.comm.Iallreduce(self.mine, self.result, op=self._MAX)

    def done(self) -> bool:
        return self.req.Test()


class VoteGate:
    """The start of a prompt: a non-blocking vote over the replica's stages (their stop requests,
    MAX), which is also their barrier. Every stage learns the same outcome, so either all of them
    start the prompt or none does (run/drain.py)."""

    def __init__(self, comm, stop_requested: Callable[[], bool]) -> None:
        self.vote, self.stop_requested = MaxVote(comm), stop_requested

    def open(self, seq: int) -> None:
        self.vote.start(int(self.stop_requested()))

    def passed(self) -> bool:
        return self.vote.done()

    def stopped(self) -> bool:
        return bool(self.vote.result[0])


class VoteDeal:
    """A slot's next job from the queue its stage's slots share on the replica's last stage
    (stage/deal.py): the last stage claims, and a non-blocking vote over the slot's stages (MAX,
    the others offering ``END``) tells them which."""

    def __init__(self, comm, queue: JobQueue | None) -> None:
        self.vote, self.queue = MaxVote(comm), queue

    def open(self) -> None:
        self.vote.start(self.queue.claim() if self.queue is not None else END)

    def dealt(self) -> int | None:
        return int(self.vote.result[0]) if self.vote.done() else None


OnStats = Callable[[Job, StageOutcome, list[StageStats]], None]


class LeaderHandoff:
    """Stage stats, with the rank's resource use, to the replica's leader (its last stage), which
    assembles the record."""

    def __init__(
        self, comm, stage: int, n_stages: int, gpu_monitor, on_record: OnStats | None,
        cpus: CpuPlacement | None = None, n_gpus: int = 0, slot: int = 0,
    ) -> None:  # fmt: skip
        self.comm, self.stage, self.leader, self.slot = comm, stage, n_stages - 1, slot
        self.cpus, self.n_gpus = cpus, n_gpus
        self.gpu_monitor = gpu_monitor  # started with the job (``started``), stopped at ``post``
        self.on_record = on_record  # the leader's: (job, its outcome, every stage's stats) -> None
        self.req = None
        self.job: Job | None = None
        self.outcome: StageOutcome | None = None
        self.stats: list[StageStats | None] = []
        self.cpu_start_s = 0.0

    def started(self) -> None:
        """The job starts on this slot (``StageProcess.on_start``): the rank's CPU time now, and
        this slot's GPU monitor (batched slots have an inactive one: their jobs overlap)."""
        self.cpu_start_s = time.process_time()
        self.gpu_monitor.start()

    def post(self, job: Job, outcome: StageOutcome) -> None:
        outcome.stats.gpus = self.gpu_monitor.stop()
        outcome.stats.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        outcome.stats.cpu_start_s, outcome.stats.cpu_end_s = self.cpu_start_s, time.process_time()
        outcome.stats.t1_perf_counter = time.perf_counter()
        if self.cpus is not None:
            outcome.stats.threads, outcome.stats.cpus = self.cpus.threads, self.cpus.bound
            outcome.stats.cores = self.cpus.cores
        outcome.stats.n_gpus = self.n_gpus
        if self.stage != self.leader:
            self.req = self.comm.isend(outcome.stats, dest=self.leader, tag=STATS_TAG)
            return
        self.job, self.outcome = replace(job, slot=self.slot), outcome  # the slot that decoded it
        self.stats = [None] * (self.leader + 1)
        self.stats[self.leader] = outcome.stats

    def delivered(self) -> bool:
        if self.stage != self.leader:
            return self.req.Test()
        for s, got in enumerate(self.stats):
            if got is None and self.comm.iprobe(source=s, tag=STATS_TAG):
                self.stats[s] = self.comm.recv(source=s, tag=STATS_TAG)
        if any(got is None for got in self.stats):
            return False
        self.on_record(self.job, self.outcome, self.stats)
        return True


class RecordAssembler:
    """The results line of one job, from the leader's outcome and every stage's stats."""

    def __init__(
        self,
        cfg: AppConfig,
        replica: int,
        transport: str,
        decode: Callable[[list[int]], str],
        epochs_window: str | None = None,
        hosts: list[str] | None = None,
        engines: list[str] | None = None,
        seams: list[str] | None = None,
    ) -> None:
        self.cfg, self.replica, self.transport, self.decode = cfg, replica, transport, decode
        self.epochs_window, self.hosts = epochs_window, list(hosts or [])
        self.engines, self.seams = list(engines or []), list(seams or [])

    def __call__(self, job: Job, outcome: StageOutcome, stats: list[StageStats]) -> Record:
        cfg = self.cfg
        sampling = job.prompt.sampling(cfg.sampling)
        n = len(outcome.tokens)
        commits = outcome.stats.commit_times
        t_wall = outcome.wall_s
        return Record(
            prompt_id=job.prompt_id,
            replica=self.replica,
            method=job.label,
            warmup=job.warmup,
            sample_idx=job.sample_idx,
            batch_size=job.batch_size,
            slot=job.slot,
            phase=job.phase,
            decoded_by=job.plan,
            route=list(job.route) if job.route is not None else None,
            plan_note=job.plan_note,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            coupling=sampling.coupling,
            position=job.prompt.position,
            request="chat" if job.prompt.chat else "prompt",
            openai=job.prompt.openai,
            truncated_tokens=job.prompt.truncated,
            end_time=time.time(),
            bytes_sent=[s.bytes_sent for s in stats],
            seq=job.seq,
            prompt_ids=job.prompt_ids,
            output_ids=outcome.tokens,
            text=self.decode(outcome.tokens),
            n_new_tokens=n,
            finish_reason=outcome.finish_reason,
            wall_s=t_wall,
            ms_per_token=1000 * t_wall / n if n else 0.0,
            ttft_s=commits[0][0] if commits else t_wall,
            window=cfg.decode.window(job.method),
            max_run_ahead=cfg.decode.max_run_ahead,
            max_verify=cfg.decode.max_verify,
            policy=cfg.decode.policy,
            draft_survival=cfg.decode.draft_survival if Policy(cfg.decode.policy).learns else None,
            max_new_tokens=job.max_new_tokens or cfg.decode.max_new_tokens,
            transport=self.transport,
            epochs_window=self.epochs_window,
            hosts=self.hosts,
            engines=self.engines,
            seams=self.seams,
            hierarchy=cfg.hierarchy.name,
            models=[s.name for s in cfg.hierarchy.stages],
            stages=stats,
        )


class Progress:
    """A replica's progress in its leader's log, every ``every_s`` and at the end: prompt runs
    done and left, output tokens/s and the ETA at that rate (``pipespec-shards
    status`` adds an array's up from the records)."""

    def __init__(self, replica: int, total: int, every_s: float, clock: Callable[[], float] = time.monotonic):
        self.replica, self.total, self.every_s, self.clock = replica, total, every_s, clock
        self.t0 = self.last = clock()
        self.done = self.tokens = self.before = 0

    def skip(self, n: int) -> None:
        """``n`` jobs a resumed run finished before: done, but not part of this run's rate."""
        self.done += n
        self.before += n

    def update(self, n_tokens: int) -> None:
        self.done += 1
        self.tokens += n_tokens
        now = self.clock()
        if now - self.last >= self.every_s or self.done == self.total:
            self.last = now
            log.info(self.line(now))

    def line(self, now: float) -> str:
        elapsed = max(now - self.t0, 1e-9)
        left = self.total - self.done
        here = self.done - self.before  # this run's: the rate of the ETA
        eta = left * elapsed / here if here else float("nan")
        return (
            f"progress: replica {self.replica}: {self.done}/{self.total} prompt runs done, {left} left, "
            f"{self.tokens / elapsed:.1f} tokens/s, elapsed {_hms(elapsed)}, ETA {_hms(eta)}"
        )


def _hms(s: float) -> str:
    if s != s:  # nan
        return "?"
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Collector:
    """The leader's end of every job: its record appended to the replica's part (flushed and
    fsynced, so a killed job loses at most the prompts in flight), progress shown."""

    def __init__(
        self, assemble: RecordAssembler, part: Path, progress=None, log_progress: Progress | None = None
    ) -> None:
        self.assemble, self.bar, self.log_progress = assemble, progress, log_progress
        self.tokens = 0  # committed tokens of every record so far (the online plan's measure)
        self.outputs: list[list[int]] = []  # the outputs since the runner last took them (``take``)
        part.parent.mkdir(parents=True, exist_ok=True)
        drop_torn_tail(part)  # a resumed run appends after what a killed one left
        self.file = open(part, "a", encoding="utf-8")  # noqa: SIM115 - open for the whole run

    def __call__(self, job: Job, outcome: StageOutcome, stats: list[StageStats]) -> None:
        rec = self.assemble(job, outcome, stats)
        self.tokens += rec.n_new_tokens
        self.outputs.append(rec.output_ids)
        self.file.write(rec.to_line())
        self.file.flush()
        os.fsync(self.file.fileno())
        if self.log_progress is not None:
            self.log_progress.update(rec.n_new_tokens)
        if self.bar is not None:
            self.bar.update(1)
            last = rec.stages[-1]
            acc = last.tokens_accepted / last.verifications if last.verifications else 0
            self.bar.set_postfix(
                method=job.plan or job.method,
                tok_s=f"{rec.n_new_tokens / rec.wall_s:.1f}",
                accepted=f"{acc:.2f}",
            )

    def take(self) -> list[list[int]]:
        """The outputs recorded since the last call."""
        out, self.outputs = self.outputs, []
        return out

    def skipped(self, n: int) -> None:
        """``n`` jobs of the next round that a resumed run already holds."""
        if n and self.log_progress is not None:
            self.log_progress.skip(n)
        if n and self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        self.file.close()
        if self.bar is not None:
            self.bar.close()


def progress_bar(cfg: AppConfig, pl: Placement, total: int):
    """A tqdm bar on replica 0's leader when ``run.progress``; None elsewhere."""
    if not (cfg.run.progress and pl.is_last and pl.replica == 0):
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=f"replica 0 ({pl.n_replicas} total)", unit="prompt")
