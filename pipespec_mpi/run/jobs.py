"""What a replica decodes: the run's prompts tokenized, its jobs planned (skipping those a resumed
run already finished), and each job's sampler."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

from pipespec_mpi.config import AppConfig
from pipespec_mpi.data.datasets import load_prompts, shard
from pipespec_mpi.records import RESULTS, read_records
from pipespec_mpi.speculative.sampling import Sampler, mix
from pipespec_mpi.topology import Placement

Prompt = tuple[str, list[int], str]  # (id, token ids, text)
JobKey = tuple[str, str, int]  # (prompt id, method, sample index)


@dataclass(frozen=True)
class Job:
    """One unit of timed work: a prompt decoded with one method."""

    seq: int
    prompt_id: str
    prompt_ids: list[int]
    method: str
    warmup: bool
    sample_idx: int = 0


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


def plan_jobs(cfg: AppConfig, prompts: list[Prompt], pl: Placement, done: set[JobKey]) -> list[Job]:
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


def done_jobs(run_dir: Path) -> set[JobKey]:
    """The (prompt, method, sample) triples a run directory already holds (for ``run.resume``):
    from results.jsonl and every part; warm-up records do not count."""
    done = set()
    for p in [run_dir / RESULTS, *sorted((run_dir / "parts").glob("*.jsonl"))]:
        if p.exists():
            done.update((r.prompt_id, r.method, r.sample_idx) for r in read_records(p) if not r.warmup)
    return done
