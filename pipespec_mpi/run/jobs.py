"""What a replica decodes: the run's prompts tokenized, its jobs planned (skipping those a resumed
run already finished), and each job's sampler."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace
from pathlib import Path

from pipespec_mpi.config import AppConfig
from pipespec_mpi.data.datasets import load_prompts, shard
from pipespec_mpi.records import RESULTS, read_records
from pipespec_mpi.speculative.sampling import Sampler, mix
from pipespec_mpi.topology import Placement

Prompt = tuple[str, list[int], str]  # (id, token ids, text)
JobKey = tuple[str, str, int, int]  # (prompt id, method, sample index, batch size)


@dataclass(frozen=True)
class Job:
    """One unit of timed work: a prompt decoded with one method, in a phase of the job whose
    sequences all decode at ``batch_size`` (``slot``: which of the phase's slots decodes it)."""

    seq: int
    prompt_id: str
    prompt_ids: list[int]
    method: str
    warmup: bool
    sample_idx: int = 0
    batch_size: int = 1
    phase: int = 0
    slot: int = 0

    @property
    def key(self) -> JobKey:
        return (self.prompt_id, self.method, self.sample_idx, self.batch_size)


def tokenize_prompts(cfg: AppConfig, tokenizer) -> list[Prompt]:
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
    return Sampler(s, key)


def batch_sizes(cfg: AppConfig) -> tuple[int, ...]:
    """The batch sizes a job decodes at: ``run.batch_sizes`` (a benchmark's sweep), else
    ``decode.batch_size``."""
    if cfg.run.mode == "benchmark" and cfg.run.batch_sizes:
        return tuple(cfg.run.batch_sizes)
    return (cfg.decode.batch_size,)


def plan_jobs(cfg: AppConfig, prompts: list[Prompt], pl: Placement, done: set[JobKey]) -> list[Job]:
    """This replica's jobs, in phases: the warm-ups (benchmark mode, batch 1), then per batch
    size one phase with the methods interleaved per prompt (batch 1: A B C A B C, so drifting
    memory bandwidth hits every method alike) or one phase per method (batched: a batch holds
    one method's sequences, so its throughput is that method's alone)."""
    methods = list(cfg.run.methods) if cfg.run.mode == "benchmark" else [cfg.method]
    mine = shard(shard(prompts, cfg.dataset.shard_index, cfg.dataset.shard_count), pl.replica, pl.n_replicas)
    jobs: list[Job] = []
    seq = phase = 0
    if cfg.run.mode == "benchmark" and mine and cfg.run.warmup_prompts:
        for pid, ids, _ in mine[: cfg.run.warmup_prompts]:
            for m in methods:
                seq += 1
                jobs.append(Job(seq, pid, ids, m, warmup=True))
    for b in batch_sizes(cfg):
        for group in [methods] if b == 1 else [[m] for m in methods]:
            phase += 1
            for pid, ids, _ in mine:
                for k in range(cfg.sampling.num_samples):
                    for m in group:
                        seq += 1
                        job = Job(seq, pid, ids, m, warmup=False, sample_idx=k, batch_size=b, phase=phase)
                        if job.key not in done:
                            jobs.append(job)
    return jobs


def phases(jobs: list[Job]) -> list[list[Job]]:
    """``jobs`` split into their phases, in order; each job's ``slot`` set: the phase's jobs are
    dealt to its ``batch_size`` slots in turn (slot s decodes the s-th, (s+B)-th, ... job)."""
    out: list[list[Job]] = []
    for job in jobs:
        if not out or out[-1][0].phase != job.phase:
            out.append([])
        out[-1].append(job)
    return [[replace(j, slot=i % j.batch_size) for i, j in enumerate(group)] for group in out]


def done_jobs(run_dir: Path) -> set[JobKey]:
    """The (prompt, method, sample, batch size) keys a run directory already holds (for ``run.resume``):
    from results.jsonl and every part; warm-up records do not count."""
    done = set()
    for p in [run_dir / RESULTS, *sorted((run_dir / "parts").glob("*.jsonl"))]:
        if p.exists():
            done.update(
                (r.prompt_id, r.method, r.sample_idx, r.batch_size) for r in read_records(p) if not r.warmup
            )
    return done
