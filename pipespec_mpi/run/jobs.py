"""What a replica decodes: the run's rows tokenized into prompts (or set aside as bad rows, with
their reason), its jobs planned (skipping those a resumed run already finished), and each job's
sampler."""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipespec_mpi.config import AppConfig, SamplingConfig
from pipespec_mpi.data.datasets import BadRow, DatasetError, Request, job_rows
from pipespec_mpi.data.requests import RowSettings
from pipespec_mpi.records import RESULTS, read_records
from pipespec_mpi.speculative.sampling import Sampler, mix


@dataclass(frozen=True)
class Prompt:
    """A request tokenized: what every stage of a replica decodes for it."""

    id: str
    ids: list[int]
    position: int  # the row's place in the dataset (data/requests.py)
    settings: RowSettings = field(default_factory=RowSettings)
    chat: bool = False  # chat turns, the template applied
    openai: bool = False  # an OpenAI batch request
    truncated: int = 0  # prompt tokens cut away (dataset.truncate)

    def max_new_tokens(self, default: int) -> int:
        return self.settings.max_tokens or default

    def sampling(self, job: SamplingConfig) -> SamplingConfig:
        return self.settings.sampling(job)


@dataclass(frozen=True)
class Prepared:
    """The run's prompts, and the rows that will not be decoded (errors.jsonl)."""

    prompts: list[Prompt]
    bad: list[BadRow]


JobKey = tuple[str, str, int, int]  # (prompt id, method, sample index, batch size)


@dataclass(frozen=True)
class Job:
    """One unit of timed work: a prompt decoded with one method, in a phase of the job whose
    sequences all decode at ``batch_size`` (``slot``: which of the phase's slots decodes it).
    Under the online plan the method and ``route`` are those it picked for the job (``plan``: its
    name, ``plan_note``: why); planned, such a job's method is ``online``."""

    seq: int
    prompt: Prompt
    method: str
    warmup: bool
    sample_idx: int = 0
    batch_size: int = 1
    phase: int = 0  # the number its phase's first job has (0: a warm-up), unique in the replica
    slot: int = 0
    route: tuple[int, ...] | None = None  # the stages it decodes on (topology.py); None: all of them
    plan: str | None = None  # the online plan's name for it (run/online.py ``Arm.name``)
    plan_note: str | None = None

    @property
    def online(self) -> bool:
        return self.plan is not None

    @property
    def label(self) -> str:
        """The method the job was asked for: what its record, summary entry and key name."""
        return "online" if self.online else self.method

    def runs_on(self, stage: int) -> bool:
        """Whether ``stage`` decodes this job (AR: the last stage alone; the others sit it out)."""
        return self.route is None or stage in self.route

    @property
    def prompt_id(self) -> str:
        return self.prompt.id

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompt.ids

    @property
    def max_new_tokens(self) -> int | None:
        """The row's own budget (None: decode.max_new_tokens)."""
        return self.prompt.settings.max_tokens

    @property
    def key(self) -> JobKey:
        return (self.prompt_id, self.label, self.sample_idx, self.batch_size)

    @property
    def store_key(self) -> str:
        """The suffix drafter's job store this job drafts from and joins: one per method and batch
        size, and the warm-ups' own. A benchmark decodes the same prompts in its warm-up and in
        every phase; drafting a prompt from its own output of another phase made it look fast
        (docs/notebook.md, "Measurements behind the code's choices"). A job that decodes each
        prompt once (run.mode=single) has one store, as before."""
        return f"{self.label}:warmup" if self.warmup else f"{self.label}:b{self.batch_size}"


def _tokens(req: Request, tokenizer, chat: bool) -> list[int]:
    if req.chat:
        return tokenizer.encode_chat(req.messages)
    return tokenizer.encode(req.text, chat=chat)


def prepare(req: Request, cfg: AppConfig, tokenizer) -> Prompt | BadRow:
    """One request tokenized, or why it cannot be decoded: empty, a budget over
    ``decode.max_new_tokens``, or longer than ``dataset.max_prompt_tokens`` (cut only when
    ``dataset.truncate`` says which end goes)."""
    ds = cfg.dataset

    def bad(reason: str) -> BadRow:
        return BadRow(req.position, req.source, reason, req.id)

    if req.chat and not any(content.strip() for _, content in req.messages):
        return bad("empty prompt: every turn's content is empty")
    if not req.chat and not req.text.strip():
        return bad("empty prompt")
    limit = cfg.decode.max_new_tokens
    if req.settings.max_tokens is not None and req.settings.max_tokens > limit:
        return bad(f"max_tokens={req.settings.max_tokens} is more than decode.max_new_tokens={limit}, "
                   "the most a job decodes per prompt (raise it to decode this row)")  # fmt: skip
    chat = cfg.hierarchy.tokenizer.chat_template if ds.chat_template is None else ds.chat_template
    try:
        ids = _tokens(req, tokenizer, chat)
    except ValueError as err:  # e.g. chat turns for a tokenizer without a chat template
        return bad(f"cannot be tokenized: {err}")
    cut, n = 0, ds.max_prompt_tokens
    if len(ids) > n:
        if ds.truncate is None:
            return bad(f"the prompt is {len(ids)} tokens, more than dataset.max_prompt_tokens={n} "
                       "(dataset.truncate=left or right cuts it instead)")  # fmt: skip
        cut = len(ids) - n
        # left: the first token (BOS) and the end stay; right: the start stays
        ids = ids[:1] + ids[len(ids) - (n - 1) :] if ds.truncate == "left" else ids[:n]
    return Prompt(req.id, ids, req.position, req.settings, req.chat, req.openai, cut)


Context = tuple[int, int, str]  # (tokens, stage, name): the smallest context of the stages


def context_problem(prompt: Prompt, context: Context | None, default_budget: int) -> str | None:
    """Why ``prompt`` with its token budget does not fit ``context`` (None: it fits)."""
    if context is None:
        return None
    limit, stage, name = context
    budget = prompt.max_new_tokens(default_budget)
    if len(prompt.ids) + budget <= limit:
        return None
    return (f"the prompt ({len(prompt.ids)} tokens) plus max_tokens ({budget}) is more than the "
            f"context of {limit} tokens of stage {stage} ({name})")  # fmt: skip


class FirstIds:
    """Where each row id was first seen, by a 64-bit digest of the id (about 100 bytes per row,
    not the id itself: a million-row job's ids are not held): a second row with an id already
    seen is a bad row (ids key the results and a resumed run)."""

    def __init__(self) -> None:
        self._first: dict[int, int] = {}

    def duplicate(self, prompt: Prompt, source: str) -> BadRow | None:
        key = int.from_bytes(hashlib.blake2b(prompt.id.encode(), digest_size=8).digest(), "little")
        first = self._first.setdefault(key, prompt.position)
        if first == prompt.position:
            return None
        return BadRow(prompt.position, source, f"duplicate id (first at row {first})", prompt.id)


def prepared_rows(cfg: AppConfig, tokenizer, context: Context | None = None) -> Iterator[Prompt | BadRow]:
    """The job's rows (``job_rows``, a stream) tokenized, in the rows' order: a ``Prompt``, or a
    ``BadRow`` for a row that cannot be decoded (``prepare``), does not fit ``context`` with
    its budget, or repeats an earlier row's id."""
    ids = FirstIds()
    for item in job_rows(cfg.dataset):
        got = item if isinstance(item, BadRow) else prepare(item, cfg, tokenizer)
        if isinstance(got, Prompt):
            why = context_problem(got, context, cfg.decode.max_new_tokens)
            if why is not None:
                got = BadRow(got.position, "context check", why, got.id)
            else:
                got = ids.duplicate(got, item.source) or got
        yield got


def tokenize_prompts(cfg: AppConfig, tokenizer, context: Context | None = None) -> Prepared:
    """``prepared_rows`` in two lists (tools and tests; a job streams them: run/rows.py)."""
    prompts, bad = [], []
    for got in prepared_rows(cfg, tokenizer, context):
        (prompts if isinstance(got, Prompt) else bad).append(got)
    return Prepared(prompts, bad)


def check_rows(n_prompts: int, bad: Sequence[BadRow], on_error: str) -> None:
    """Stop the job when a bad row must stop it (``run.on_error=fail``), or when no row is left
    (``n_prompts`` rows can be decoded)."""
    err = None
    if bad and on_error == "fail":
        b = bad[0]
        err = DatasetError(
            f"row {b.position} ({b.source}, id {b.id!r}): {b.reason}; {len(bad)} bad "
            "row(s) in all (run.on_error=skip writes them to errors.jsonl and decodes the rest)"
        )
    elif not n_prompts:
        reasons = "; ".join(sorted({b.reason for b in bad})[:3])
        err = DatasetError(f"none of the {len(bad)} rows can be decoded (errors.jsonl): {reasons}")
    if err is not None:
        err.collective = True
        raise err


def sampler_for(cfg: AppConfig, job: Job) -> Sampler:
    """The job's sampler: the job's sampling with its row's own settings; its noise depends on
    (seed, prompt, sample index) only, so every method and every rerun of the same sample draws
    the same tokens."""
    s = job.prompt.sampling(cfg.sampling)
    key = mix(s.seed, zlib.crc32(job.prompt_id.encode()), job.sample_idx)
    return Sampler(s, key)


def batch_sizes(cfg: AppConfig) -> tuple[int, ...]:
    """The batch sizes a job decodes at: ``run.batch_sizes`` (a benchmark's sweep), else
    ``decode.batch_size``."""
    if cfg.run.mode == "benchmark" and cfg.run.batch_sizes:
        return tuple(cfg.run.batch_sizes)
    return (cfg.decode.batch_size,)


def job_methods(cfg: AppConfig) -> list[str]:
    return list(cfg.run.methods) if cfg.run.mode == "benchmark" else [cfg.method]


def _warmups(cfg: AppConfig, n_prompts: int) -> int:
    return min(cfg.run.warmup_prompts, n_prompts) if cfg.run.mode == "benchmark" else 0


def plan_jobs(
    cfg: AppConfig, prompts: list[Prompt], done: set[JobKey], warmups: bool = True, first_seq: int = 0
) -> list[Job]:
    """Jobs for ``prompts`` (a replica's share of the job's rows, or of one round of them:
    run/rows.py), in phases: the warm-ups (benchmark mode, batch 1; ``warmups``: in the first
    round only), then per batch size one phase with the methods interleaved per prompt (batch 1:
    A B C A B C, so drifting memory bandwidth hits every method alike) or one phase per method
    (batched: a batch holds one method's sequences, so its throughput is that method's alone).
    Jobs are numbered from ``first_seq`` + 1, a phase by its first job's number (so that a
    phase's records are told apart from a later phase's, of this round or another, at the same
    batch size); those in ``done`` (a resumed run's) are left out."""
    methods = job_methods(cfg)
    jobs: list[Job] = []
    seq = first_seq
    for p in prompts[: _warmups(cfg, len(prompts)) if warmups else 0]:
        for m in methods:
            seq += 1
            jobs.append(Job(seq, p, m, warmup=True))
    for b in batch_sizes(cfg):
        for group in [methods] if b == 1 else [[m] for m in methods]:
            phase = seq + 1
            for p in prompts:
                for k in range(cfg.sampling.num_samples):
                    for m in group:
                        seq += 1
                        job = Job(seq, p, m, warmup=False, sample_idx=k, batch_size=b, phase=phase)
                        if job.key not in done:
                            jobs.append(job)
    return jobs


def count_jobs(cfg: AppConfig, n_prompts: int, warmups: bool = True) -> int:
    """How many jobs ``plan_jobs`` numbers for ``n_prompts`` prompts, done or not (a replica's
    total, known before its rows are read: progress and ETA; a round's, to number the next)."""
    per_prompt = cfg.sampling.num_samples * len(job_methods(cfg)) * len(batch_sizes(cfg))
    warm = _warmups(cfg, n_prompts) * len(job_methods(cfg)) if warmups else 0
    return warm + n_prompts * per_prompt


def phases(jobs: list[Job]) -> list[list[Job]]:
    """``jobs`` split into their phases, in order (which slot decodes a job is decided as the
    phase runs: stage/deal.py)."""
    out: list[list[Job]] = []
    for job in jobs:
        if not out or out[-1][0].phase != job.phase:
            out.append([])
        out[-1].append(job)
    return out


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
