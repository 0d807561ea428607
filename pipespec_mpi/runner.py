"""One job on one rank: place the rank, load its stage, decode the replica's prompts, write results.

Data path: prompts (rank 0 loads and tokenizes, broadcasts) -> per prompt and method, driven by
``StageProcess`` (stage/process.py): reset the window header, the start gate (a non-blocking
barrier of the replica), the stage loop, the stage stats to the replica's leader (its last stage)
-> one ``Record`` (records.py) appended to ``parts/replica-<r>.jsonl`` -> at the end rank 0 merges
the parts into ``results.jsonl`` and writes ``summary.json`` (and ``benchmark.json``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pipespec_mpi import metrics
from pipespec_mpi.comm.bootstrap import World, init_torch_distributed, mpi
from pipespec_mpi.comm.channel import Receiver, Sender
from pipespec_mpi.comm.wait import StallError, wait_until
from pipespec_mpi.comm.window import EpochWindow, SharedEpochWindow
from pipespec_mpi.config import AppConfig
from pipespec_mpi.data.datasets import DatasetError, load_prompts, shard
from pipespec_mpi.errors import UserError
from pipespec_mpi.faults import maybe_fail
from pipespec_mpi.records import (
    BENCHMARK,
    RESULTS,
    SUMMARY,
    BenchmarkRow,
    Record,
    drop_torn_tail,
    read_records,
    write_benchmark,
    write_records,
    write_summary,
)
from pipespec_mpi.speculative.sampling import Sampler, mix
from pipespec_mpi.speculative.verifiers import make_verifier
from pipespec_mpi.stage.loop import StageLoop, StageRole
from pipespec_mpi.stage.process import StageProcess, drive
from pipespec_mpi.stage.stats import StageOutcome, StageStats
from pipespec_mpi.topology import Placement, device_for, place

log = logging.getLogger("pipespec_mpi")


class TokenizerMismatch(UserError):
    pass


class PromptTooLong(UserError):
    pass


STATS_TAG = 11


@dataclass(frozen=True)
class Job:
    """One unit of timed work: a prompt decoded with one method."""

    seq: int
    prompt_id: str
    prompt_ids: list[int]
    method: str
    warmup: bool
    sample_idx: int = 0


def resolve_transport(kind: str) -> str:
    import torch

    if kind != "auto":
        return kind
    return "nccl" if torch.cuda.is_available() else "mpi"


def set_threads(threads: int | None, local_size: int) -> int:
    import torch

    mine = len(os.sched_getaffinity(0))
    # A launcher that binds each rank to its own CPUs (srun --cpus-per-task) already gave us our
    # share; otherwise the node's ranks split the CPUs they all see.
    shared = mine >= (os.cpu_count() or mine)
    n = threads or max(1, mine // local_size if shared else mine)
    torch.set_num_threads(n)
    return n


def tokenize_prompts(cfg: AppConfig, tokenizer) -> list[tuple[str, list[int], str]]:
    """(id, token ids, text) for the run's prompts; raises on prompts that cannot fit."""
    chat = cfg.dataset.chat_template
    if chat is None:
        chat = cfg.hierarchy.tokenizer.chat_template
    out = []
    for item in load_prompts(cfg.dataset):
        ids = tokenizer.encode(item.text, chat=chat)
        if len(ids) > cfg.dataset.max_prompt_tokens:
            ids = ids[:1] + ids[-(cfg.dataset.max_prompt_tokens - 1) :]  # keep BOS and the end
        out.append((item.id, ids, item.text))
    return out


def sampler_for(cfg: AppConfig, job: Job) -> Sampler:
    """The job's sampler: its noise depends on (seed, prompt, sample index) only, so every
    method and every rerun of the same sample draws the same tokens."""
    s = cfg.sampling
    key = mix(s.seed, zlib.crc32(job.prompt_id.encode()), job.sample_idx)
    return Sampler(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, key=key, coupling=s.coupling)


def plan_jobs(cfg: AppConfig, prompts: list, pl: Placement, done: set[tuple[str, str, int]]) -> list[Job]:
    """This replica's jobs: its shard of the prompts, interleaving methods in benchmark mode."""
    methods = list(cfg.run.methods) if cfg.run.mode == "benchmark" else [cfg.method]
    mine = shard(shard(prompts, cfg.dataset.shard_index, cfg.dataset.shard_count), pl.replica, pl.n_replicas)
    jobs: list[Job] = []
    seq = 0
    if cfg.run.mode == "benchmark" and mine and cfg.run.warmup_prompts:
        for pid, ids, _ in mine[: cfg.run.warmup_prompts]:
            for m in methods:
                seq += 1
                jobs.append(Job(seq, pid, ids, m, warmup=True))
    for pid, ids, _ in mine:
        for k in range(cfg.sampling.num_samples):
            for m in methods:
                seq += 1
                if (pid, m, k) not in done:
                    jobs.append(Job(seq, pid, ids, m, warmup=False, sample_idx=k))
    return jobs


class PerfClock:
    """The stage's clock on a rank: ``time.perf_counter`` (one clock for the processes of a node)."""

    def now(self) -> float:
        return time.perf_counter()


class BarrierGate:
    """The start of a prompt: a non-blocking barrier over the replica's stages."""

    def __init__(self, comm) -> None:
        self.comm = comm
        self.req = None

    def open(self, seq: int) -> None:
        self.req = self.comm.Ibarrier()

    def passed(self) -> bool:
        return self.req.Test()


class LeaderHandoff:
    """Stage stats, with the rank's resource use, to the replica's leader (its last stage), which
    assembles the record."""

    def __init__(self, comm, stage: int, n_stages: int, gpu_monitor, on_record) -> None:
        self.comm, self.stage, self.leader = comm, stage, n_stages - 1
        self.gpu_monitor = gpu_monitor  # started when the prompt starts (StageProcess.on_start)
        self.on_record = on_record  # leader: (job, its outcome, every stage's stats) -> None
        self.req = None
        self.job = self.outcome = None
        self.stats: list[StageStats | None] = []

    def post(self, job, outcome: StageOutcome) -> None:
        outcome.stats.gpus = self.gpu_monitor.stop()
        outcome.stats.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        if self.stage != self.leader:
            self.req = self.comm.isend(outcome.stats, dest=self.leader, tag=STATS_TAG)
            return
        self.job, self.outcome = job, outcome
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


class Runner:
    def __init__(self, cfg: AppConfig, run_dir: Path, world: World) -> None:
        self.cfg, self.run_dir, self.world = cfg, run_dir, world
        self.MPI = mpi()
        self.comm = self.MPI.COMM_WORLD
        self.pl = place(world.rank, world.size, cfg.hierarchy.n_stages)

    # ------------------------------------------------------------------ setup
    def _load(self) -> None:
        from pipespec_mpi.models.loader import load_stage, load_tokenizer

        cfg, pl = self.cfg, self.pl
        stage_cfg = cfg.hierarchy.stages[pl.stage]
        self.threads = set_threads(stage_cfg.threads, self.world.local_size)
        self.transport = resolve_transport(cfg.transport.kind)
        import torch

        n_gpus = torch.cuda.device_count()
        self.cuda_devices = device_for(
            [s.n_gpus for s in cfg.hierarchy.stages], pl.stage, self.world.local_rank, n_gpus
        )
        if self.transport in ("gloo", "nccl"):
            if self.transport == "nccl" and not torch.cuda.is_available():
                raise RuntimeError("transport.kind=nccl needs CUDA; use transport.kind=mpi or gloo on CPUs")
            init_torch_distributed(self.world, self.transport, cfg.transport.iface)

        self.tokenizer = load_tokenizer(cfg.hierarchy.tokenizer, cfg.hierarchy.name)
        self._check_tokenizers()
        prompts = err = None
        if self.world.rank == 0:
            try:
                prompts = tokenize_prompts(cfg, self.tokenizer)
                if not prompts:
                    raise DatasetError(f"dataset {cfg.dataset.name!r} gave no prompts")
            except UserError as e:  # reported by rank 0, raised on every rank
                err = e
        self.prompts, err = self.comm.bcast((prompts, err), root=0)
        if err is not None:
            err.collective = True
            raise err

        t0 = time.perf_counter()
        self.model = load_stage(cfg.hierarchy, pl.stage, self.cuda_devices)
        log.info(
            "stage %d (%s) loaded in %.1f s, %d threads, transport %s",
            *(pl.stage, stage_cfg.name, time.perf_counter() - t0, self.threads, self.transport),
        )
        self._check_vocab()
        from pipespec_mpi.gpu_monitor import GpuMonitor

        self.gpu_monitor = GpuMonitor(self.cuda_devices if torch.cuda.is_available() else [])

    def _check_tokenizers(self) -> None:
        """Every stage must use the hierarchy's token ids: compare tokenizer fingerprints."""
        from pipespec_mpi.models.loader import stage_tokenizer, tokenizer_mismatches

        st = stage_tokenizer(self.cfg.hierarchy, self.pl.stage)
        mine = (self.pl.stage, self.cfg.hierarchy.stages[self.pl.stage].name,
                st.fingerprint() if st is not None else None)  # fmt: skip
        bad = tokenizer_mismatches(self.tokenizer.fingerprint(), self.comm.allgather(mine))
        if bad:
            err = TokenizerMismatch("stages do not share one tokenizer: " + "; ".join(bad))
            err.collective = True  # every rank saw the same gathered fingerprints
            raise err

    def _check_vocab(self) -> None:
        """All stages must speak the tokenizer's ids: gather (stage, model vocab) and compare."""
        vocab = getattr(self.model, "vocab_size", None)
        name = self.cfg.hierarchy.stages[self.pl.stage].name
        context = getattr(self.model, "max_context", None)
        longest = max(len(ids) for _, ids, _ in self.prompts) + self.cfg.decode.max_new_tokens
        if context is not None and longest > context:
            raise PromptTooLong(
                f"stage {self.pl.stage} ({name}): the longest prompt plus max_new_tokens is {longest} "
                f"tokens, more than the model's context of {context}; lower dataset.max_prompt_tokens "
                "or max_new_tokens"
            )
        got = self.comm.allgather((self.pl.stage, name, vocab))
        widths = {v for _, _, v in got if v is not None}
        self.vocab = max(widths)
        if (
            len(widths) > 1
            and self.cfg.sampling.temperature > 0
            and self.cfg.sampling.coupling == "leviathan"
        ):
            raise TokenizerMismatch(f"sampling needs equal logit widths across stages, got {sorted(widths)}")
        need = self.tokenizer.vocab_size
        bad = [
            f"stage {s} ({n}): model vocabulary {v} < tokenizer's {need}"
            for s, n, v in got
            if v is not None and v < need
        ]
        if bad:
            raise TokenizerMismatch("model vocabularies too small: " + "; ".join(sorted(set(bad))))

    def _connect(self) -> None:
        cfg, pl = self.cfg, self.pl
        device = None
        if self.transport == "nccl":
            import torch

            device = torch.device(f"cuda:{self.cuda_devices[0]}")
        t = cfg.transport
        # Leviathan sampling: each proposal carries the float32 distribution it was drawn from.
        leviathan = cfg.sampling.temperature > 0 and cfg.sampling.coupling == "leviathan"
        dist_width = self.vocab if leviathan else 0
        width = min(t.max_msg_tokens, 8) if dist_width > 4096 else t.max_msg_tokens
        chan = dict(depth=t.depth, max_msg_tokens=width, device=device, dist_width=dist_width)
        self.sender = (
            Sender(self.transport, self.comm, pl.downstream, **chan) if pl.downstream is not None else None
        )
        self.receiver = (
            Receiver(self.transport, self.comm, pl.upstream, **chan) if pl.upstream is not None else None
        )
        max_tokens = cfg.decode.max_new_tokens + cfg.decode.max_verify + 2
        # Every pipeline on one node (the usual case): a shared-memory window whose reads never
        # wait for the owner. Pipelines spanning nodes: the passive-target RMA window.
        hosts = self.comm.allgather(self.world.hostname)
        local = all(hosts[r] == hosts[r - r % pl.n_stages] for r in range(len(hosts)))
        self.node_comm = self.comm.Split_type(self.MPI.COMM_TYPE_SHARED, key=self.world.rank)
        if local and cfg.run.epochs_window != "rma":
            self.window = SharedEpochWindow(self.node_comm, max_tokens, self.world.rank)
        else:
            self.window = EpochWindow(self.comm, max_tokens)
        self.replica_comm = self.comm.Split(color=pl.replica, key=pl.stage)
        role = StageRole(pl.stage, pl.n_stages, pl.world_rank, pl.upstream, pl.downstream)
        self.loop = StageLoop(
            role, self.model, self.window, self.sender, self.receiver, PerfClock(), cfg.decode,
            self.tokenizer.eos_token_id, vocab=self.vocab,
        )  # fmt: skip

    # ------------------------------------------------------------------ per prompt
    def _wait(self, cond, what: str) -> None:
        """Wait without spinning, taking in proposals (kept for their prompt) and beating."""

        def check() -> bool:
            self.loop.pump()
            return cond()

        wait_until(check, self.cfg.run.stall_timeout_s, what)

    def _barrier(self, comm, what: str) -> None:
        req = comm.Ibarrier()
        self._wait(lambda: req.Test(), what)

    def _record(self, job: Job, outcome: StageOutcome, stats: list[StageStats]) -> Record:
        """The results line of one job, assembled by the replica's leader."""
        cfg = self.cfg
        n = len(outcome.tokens)
        commits = outcome.stats.commit_times
        t_wall = outcome.wall_s
        return Record(
            prompt_id=job.prompt_id,
            replica=self.pl.replica,
            method=job.method,
            warmup=job.warmup,
            sample_idx=job.sample_idx,
            temperature=cfg.sampling.temperature,
            coupling=cfg.sampling.coupling,
            bytes_sent=[s.bytes_sent for s in stats],
            seq=job.seq,
            prompt_ids=job.prompt_ids,
            output_ids=outcome.tokens,
            text=self.tokenizer.decode(outcome.tokens),
            n_new_tokens=n,
            finish_reason=outcome.finish_reason,
            wall_s=t_wall,
            ms_per_token=1000 * t_wall / n if n else 0.0,
            ttft_s=commits[0][0] if commits else t_wall,
            lookahead=cfg.decode.window(job.method),
            max_run_ahead=cfg.decode.max_run_ahead,
            max_verify=cfg.decode.max_verify,
            max_new_tokens=cfg.decode.max_new_tokens,
            transport=self.transport,
            hierarchy=cfg.hierarchy.name,
            models=[s.name for s in cfg.hierarchy.stages],
            stages=stats,
        )

    # ------------------------------------------------------------------ the job
    def part_path(self, replica: int) -> Path:
        return self.run_dir / "parts" / f"replica-{replica}.jsonl"

    def _done_jobs(self) -> set[tuple[str, str, int]]:
        """What a resumed run already finished, read by rank 0 for every rank (an unreadable
        results file is raised on every rank, reported once)."""
        done = err = None
        if self.world.rank == 0 and self.cfg.run.resume:
            try:
                done = set()
                for p in [self.run_dir / RESULTS, *sorted((self.run_dir / "parts").glob("*.jsonl"))]:
                    if p.exists():
                        done.update(
                            (r.prompt_id, r.method, r.sample_idx) for r in read_records(p) if not r.warmup
                        )
            except UserError as e:
                err = e
        done, err = self.comm.bcast((done, err), root=0)
        if err is not None:
            err.collective = True
            raise err
        return done or set()

    def run(self) -> None:
        self._load()
        self._connect()
        done = self._done_jobs()
        jobs = plan_jobs(self.cfg, self.prompts, self.pl, done)
        part = None
        if self.pl.is_last:
            self.part_path(self.pl.replica).parent.mkdir(parents=True, exist_ok=True)
            drop_torn_tail(self.part_path(self.pl.replica))  # a resumed run appends after a killed one
            part = open(self.part_path(self.pl.replica), "a", encoding="utf-8")  # noqa: SIM115
        bar = self._progress(len(jobs))
        index = {job.seq: i for i, job in enumerate(jobs)}

        def start(job: Job) -> None:
            maybe_fail(self.world.rank, index[job.seq])
            self.gpu_monitor.start()

        def write(job: Job, outcome: StageOutcome, stats: list[StageStats]) -> None:
            rec = self._record(job, outcome, stats)
            part.write(json.dumps(rec.to_json()) + "\n")
            part.flush()
            os.fsync(part.fileno())
            if bar is not None:
                bar.update(1)
                last = rec.stages[-1]
                acc = last.tokens_accepted / last.verifications if last.verifications else 0
                bar.set_postfix(
                    method=job.method,
                    tok_s=f"{rec.n_new_tokens / rec.wall_s:.1f}",
                    accepted=f"{acc:.2f}",
                )

        handoff = LeaderHandoff(self.replica_comm, self.pl.stage, self.pl.n_stages, self.gpu_monitor, write)
        process = StageProcess(
            self.loop, BarrierGate(self.replica_comm), handoff, jobs,
            verifier_for=lambda job: make_verifier(sampler_for(self.cfg, job), self.pl.stage), on_start=start,
        )  # fmt: skip
        try:
            drive(process, self.cfg.run.stall_timeout_s)
        except StallError as err:
            raise StallError(f"{err}{self._culprits()}") from err
        if part is not None:
            part.close()
        if bar is not None:
            bar.close()
        self._barrier(self.comm, "all replicas to finish")
        if self.world.rank == 0:
            self._finalize()
        self._barrier(self.comm, "rank 0 to write the summary")
        # Graceful close only on success: after an error this rank aborts the job instead of
        # waiting for peers that may never answer.
        self._close()

    def _culprits(self) -> str:
        """Which peers of this replica stopped answering, judged by their heartbeats."""
        limit = self.cfg.run.stall_timeout_s / 2
        stale = []
        for s, r in enumerate(self.pl.replica_ranks()):
            age = self.window.heartbeat_age_s(r)
            if r != self.world.rank and age > limit:
                name = self.cfg.hierarchy.stages[s].name
                stale.append(
                    f"rank {r} (stage {s}, {name}) stopped answering: last heartbeat {age:.0f} s ago"
                )
        return "; " + "; ".join(stale) if stale else "; no peer's heartbeat is stale (a slow forward?)"

    def _progress(self, total: int):
        if not (self.cfg.run.progress and self.pl.is_last and self.pl.replica == 0):
            return None
        from tqdm import tqdm

        return tqdm(total=total, desc=f"replica 0 ({self.pl.n_replicas} total)", unit="prompt")

    def _close(self) -> None:
        if self.sender is not None:
            self.sender.close(lambda c, w: wait_until(c, self.cfg.run.stall_timeout_s, w))
        if self.receiver is not None:
            self.receiver.close(lambda c, w: wait_until(c, self.cfg.run.stall_timeout_s, w))
        self.window.free()
        self.replica_comm.Free()
        self.node_comm.Free()

    def _finalize(self) -> None:
        records = [
            r for p in sorted((self.run_dir / "parts").glob("replica-*.jsonl")) for r in read_records(p)
        ]
        order = {pid: i for i, (pid, _, _) in enumerate(self.prompts)}
        records.sort(key=lambda r: (r.warmup is not True, order.get(r.prompt_id, 0), r.seq))
        write_records(self.run_dir / RESULTS, records)
        summary = metrics.summarize(records)
        write_summary(self.run_dir / SUMMARY, summary)
        if self.cfg.run.mode == "benchmark":
            bench = metrics.benchmark_table(records, self.cfg.run.methods)
            write_benchmark(self.run_dir / BENCHMARK, bench)
            print(format_benchmark(bench), flush=True)
        else:
            for m, s in summary.items():
                acc = {k: round(v, 2) for k, v in s.mean_accepted_per_verification.items()}
                print(
                    f"[pipespec_mpi] {m}: {s.n_prompts} prompts, {s.n_tokens} tokens, "
                    f"{s.ms_per_token:.2f} ms/token, {s.tokens_per_s:.1f} tokens/s, "
                    f"accepted/verification {acc}",
                    flush=True,
                )
        print(f"[pipespec_mpi] results in {self.run_dir}", flush=True)


def format_benchmark(bench: Mapping[str, BenchmarkRow]) -> str:
    lines = [f"{'method':<10}{'ms/token':>10}{'tokens/s':>10}{'speedup':>9}{'median':>8}{'min':>7}{'max':>7}"]
    nan = math.nan
    for m, row in bench.items():
        pp = row.speedup_per_prompt
        speedup = row.speedup if row.speedup is not None else nan
        median, lo, hi = (pp.median, pp.min, pp.max) if pp is not None else (nan, nan, nan)
        lines.append(
            f"{m:<10}{row.ms_per_token:>10.2f}{row.tokens_per_s:>10.1f}{speedup:>9.2f}"
            f"{median:>8.2f}{lo:>7.2f}{hi:>7.2f}"
        )
    return "\n".join(lines)
