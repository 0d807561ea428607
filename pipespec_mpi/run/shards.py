"""A job array's shards: what is missing, resubmitting only that, and merging the shards.

  pipespec-shards status   outputs/slurm/<array job id>
  pipespec-shards resubmit outputs/slurm/<array job id> [--dry-run] [-- SBATCH OPTIONS]
  pipespec-shards merge    outputs/slurm/<array job id>

An array run directory holds ``shard-<i>/`` per task (slurm/pipespec_array.sbatch). A shard is
finished when its run directory holds every (prompt, method, sample) its config asks for; what a
shard should hold is recomputed from its own ``.hydra/config.yaml`` (the dataset, the shard, the
methods), and what it holds is what ``run.resume`` would skip. ``resubmit`` submits the unfinished
shards as one array (``--array=1,3``) into the same directory with ``run.resume=true``, so each
redoes only its missing prompts; ``merge`` writes the array directory's ``results.jsonl``,
``summary.json`` (and ``benchmark.json``) from every shard, as one run would.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from pipespec_mpi.analysis import table
from pipespec_mpi.analysis.table import Column, cell
from pipespec_mpi.config import AppConfig, load_run_config
from pipespec_mpi.errors import UserError, tool_error
from pipespec_mpi.records import ERRORS, RESULTS, Record, iter_records, read_errors, write_errors
from pipespec_mpi.run.jobs import JobKey, Prompt, done_jobs, plan_jobs

ROOT = Path(__file__).resolve().parents[2]  # the checkout: slurm/ beside pipespec_mpi/
ARRAY_SCRIPT = ROOT / "slurm" / "pipespec_array.sbatch"
SHARD_DIR = re.compile(r"shard-(\d+)$")
# the overrides the array script adds itself (and resubmit sets again)
OWN_OVERRIDES = ("hydra.run.dir=", "++dataset.shard_index=", "++dataset.shard_count=", "run.resume=")


class ShardError(UserError):
    pass


@dataclass(frozen=True)
class ShardState:
    index: int
    expected: int  # (prompt, method, sample, batch size) jobs its config asks for, bad rows not
    done: int
    started: bool  # its run directory exists
    errors: int = 0  # its rows in errors.jsonl (never decoded)
    tokens: int = 0  # output tokens of its done jobs
    span_s: float = 0.0  # from its first record's start to its last record's end (Unix times)

    @property
    def finished(self) -> bool:
        return self.started and self.done >= self.expected

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.span_s if self.span_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """At its rate so far: None before two of its jobs have ended."""
        if self.finished:
            return 0.0
        if self.done < 2 or self.span_s <= 0:
            return None
        return (self.expected - self.done) * self.span_s / self.done


def shard_dirs(array_dir: Path) -> dict[int, Path]:
    found = {}
    for p in Path(array_dir).iterdir() if Path(array_dir).is_dir() else ():
        m = SHARD_DIR.match(p.name)
        if m and p.is_dir():
            found[int(m.group(1))] = p
    return dict(sorted(found.items()))


def run_config(run_dir: Path) -> AppConfig:
    """The typed config a run directory was made with (its ``.hydra/config.yaml``)."""
    try:
        return load_run_config(run_dir)
    except FileNotFoundError as err:
        raise ShardError(str(err)) from None


def expected_jobs(cfg: AppConfig, bad_positions: set[int] = frozenset()) -> set[JobKey]:
    """What a run of ``cfg`` decodes: the measured jobs the runner plans (run/jobs.py
    ``plan_jobs``, the one enumeration) for its shard of the rows (those not at
    ``bad_positions``, errors.jsonl's, nor unreadable); no tokenizer needed, only the rows' ids."""
    from pipespec_mpi.data.datasets import Request, job_rows

    rows = (p for p in job_rows(cfg.dataset) if isinstance(p, Request) and p.position not in bad_positions)
    prompts = [Prompt(p.id, [], p.position) for p in rows]
    return {job.key for job in plan_jobs(cfg, prompts, done=set(), warmups=False)}


def _activity(run_dir: Path, want: set[JobKey]) -> tuple[int, float]:
    """Output tokens of the wanted jobs a run directory holds, and the span of their records."""
    tokens, first, last = 0, None, None
    for p in [run_dir / RESULTS, *sorted((run_dir / "parts").glob("*.jsonl"))]:
        if not p.exists():
            continue
        for r in iter_records(p):
            if r.warmup or (r.prompt_id, r.method, r.sample_idx, r.batch_size) not in want:
                continue
            tokens += r.n_new_tokens
            if r.end_time is not None:
                first = min(first or r.end_time, r.end_time - r.wall_s)
                last = max(last or r.end_time, r.end_time)
    return tokens, (last - first) if first is not None else 0.0


def array_config(array_dir: Path) -> AppConfig:
    dirs = shard_dirs(array_dir)
    for d in dirs.values():
        if (d / ".hydra" / "config.yaml").exists():
            return run_config(d)
    raise ShardError(f"{array_dir}: no shard-<i>/ with a .hydra/config.yaml: nothing to go by")


def status(array_dir: Path) -> tuple[AppConfig, list[ShardState]]:
    """Every shard of the array (also those that never started), finished or not."""
    cfg = array_config(array_dir)
    dirs = shard_dirs(array_dir)
    out = []
    for i in range(cfg.dataset.shard_count):
        mine = replace(cfg, dataset=replace(cfg.dataset, shard_index=i))
        d = dirs.get(i)
        errors = read_errors(d / ERRORS) if d is not None else []
        want = expected_jobs(mine, {e["position"] for e in errors})
        have = done_jobs(d) & want if d is not None else set()
        tokens, span = _activity(d, have) if d is not None else (0, 0.0)
        out.append(ShardState(i, len(want), len(have), d is not None, len(errors), tokens, span))
    return cfg, out


def array_spec(indices: Sequence[int]) -> str:
    """Slurm's --array value: runs of consecutive ids as ranges (``0-2,5``)."""
    parts, run = [], []
    for i in sorted(indices):
        if run and i != run[-1] + 1:
            parts.append(run)
            run = []
        run.append(i)
    if run:
        parts.append(run)
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in parts)


def user_overrides(array_dir: Path) -> list[str]:
    """The Hydra overrides the array was submitted with (from a shard's .hydra/overrides.yaml)."""
    from omegaconf import OmegaConf

    for d in shard_dirs(array_dir).values():
        path = d / ".hydra" / "overrides.yaml"
        if path.exists():
            return [o for o in OmegaConf.load(path) if not str(o).startswith(OWN_OVERRIDES)]
    raise ShardError(f"{array_dir}: no shard has .hydra/overrides.yaml")


def resubmit_command(
    array_dir: Path, missing: Sequence[int], count: int, sbatch_args: Sequence[str]
) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of the sbatch that reruns ``missing`` into ``array_dir``."""
    argv = ["sbatch", f"--array={array_spec(missing)}", *sbatch_args, str(ARRAY_SCRIPT)]
    argv += user_overrides(array_dir)
    env = {"PIPESPEC_SHARDS_OF": str(Path(array_dir).resolve()), "PIPESPEC_SHARD_COUNT": str(count)}
    return argv, env


def merge(array_dir: Path) -> int:
    """Every shard's records (results.jsonl and parts, each job once) written as the array
    directory's results.jsonl, summary.json and benchmark.json, read as streams; the records
    merged."""
    from pipespec_mpi.run.finalize import write_run_files

    cfg = array_config(array_dir)
    dirs = list(shard_dirs(array_dir).values())
    errors: dict[int, dict] = {}
    for d in dirs:
        for e in read_errors(d / ERRORS):
            errors.setdefault(e["position"], e)
    seen: set[tuple] = set()

    def records() -> Iterator[Record]:
        for d in dirs:
            for p in [d / RESULTS, *sorted((d / "parts").glob("*.jsonl"))]:
                if p.exists():
                    for r in iter_records(p):
                        key = (r.prompt_id, r.method, r.sample_idx, r.batch_size, r.warmup)
                        if key not in seen:
                            seen.add(key)
                            yield r

    bad = [errors[k] for k in sorted(errors)]
    write_errors(Path(array_dir) / ERRORS, bad)
    write_run_files(cfg, Path(array_dir), records(), bad)
    return len(seen)


STATUS_COLUMNS = (
    Column("shard"), Column("done", True), Column("expected", True), Column("state"),
    Column("bad rows", True), Column("tokens/s", True), Column("ETA min", True),
)  # fmt: skip


def format_status(states: Sequence[ShardState]) -> str:
    """One row per shard, then the array's totals and what is missing (``shards status``)."""
    rows = [
        [f"shard-{s.index}", str(s.done), str(s.expected),
         "finished" if s.finished else "not started" if not s.started else "unfinished", str(s.errors),
         f"{s.tokens_per_s:.1f}" if s.span_s else "-", cell(s.eta_s and s.eta_s / 60, ".1f")]
        for s in states
    ]  # fmt: skip
    done, expected = sum(s.done for s in states), sum(s.expected for s in states)
    running = [s for s in states if s.started and not s.finished and s.eta_s is not None]
    eta = max((s.eta_s for s in running), default=None)  # the shards run side by side
    missing = [s.index for s in states if not s.finished]
    notes = [f"array: {done}/{expected} jobs done, {sum(s.errors for s in states)} bad rows, "
             f"{sum(s.tokens for s in states)} tokens"
             + (f", ETA {eta / 60:.1f} min for the running shards" if eta else ""),
             f"missing: {array_spec(missing) or 'none'}"]  # fmt: skip
    return table.text(STATUS_COLUMNS, rows, notes)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pipespec-shards", description=__doc__.split("\n")[0])
    ap.add_argument("action", choices=["status", "resubmit", "merge"])
    ap.add_argument("array_dir", type=Path, help="outputs/slurm/<array job id> (holds shard-<i>/)")
    ap.add_argument("--dry-run", action="store_true", help="resubmit: print the sbatch, do not run it")
    ap.add_argument("sbatch_args", nargs="*", help="resubmit: options for sbatch (after --)")
    a = ap.parse_args(argv)
    try:
        cfg, states = status(a.array_dir)
        missing = [s.index for s in states if not s.finished]
        if a.action == "status":
            print(format_status(states))
            return 0 if not missing else 3
        if a.action == "resubmit":
            if not missing:
                print("every shard is finished: nothing to resubmit")
                return 0
            cmd, env = resubmit_command(a.array_dir, missing, cfg.dataset.shard_count, a.sbatch_args)
            shown = " ".join(f"{k}={v}" for k, v in env.items()) + " " + " ".join(cmd)
            if a.dry_run:
                print(shown)
                return 0
            print(shown, flush=True)
            return subprocess.run(cmd, env={**os.environ, **env}, cwd=ROOT).returncode
        merged = merge(a.array_dir)
        print(f"merged {merged} records of {len(states)} shards into {a.array_dir}")
        if missing:
            print(f"still missing: shards {array_spec(missing)}", file=sys.stderr)
            return 3
        return 0
    except UserError as err:
        return tool_error(ap.prog, err)


if __name__ == "__main__":
    sys.exit(main())
