"""The end of a run, on rank 0: every replica's part merged into results.jsonl (warm-ups first,
then in prompt order), the file of ``run.output_format`` (run/outputs.py), summary.json,
benchmark.json (run.mode=benchmark), a printed table, and under Slurm the job's accounting
appended to slurm.json. errors.jsonl (the rows not decoded) was written at the start."""

from __future__ import annotations

import heapq
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from operator import itemgetter
from pathlib import Path
from typing import Any

from pipespec_mpi.analysis import metrics, table
from pipespec_mpi.analysis.table import Column, cell
from pipespec_mpi.config import AppConfig
from pipespec_mpi.records import (
    BENCHMARK,
    ERRORS,
    RESULTS,
    SUMMARY,
    BenchmarkRow,
    Record,
    iter_records,
    read_errors,
    write_benchmark,
    write_summary,
)
from pipespec_mpi.run.outputs import write_outputs
from pipespec_mpi.run.slurm_info import append_slurm_record


def finalize(cfg: AppConfig, run_dir: Path) -> None:
    """The run's files from its parts (read as streams: no file's records are held at once)."""
    parts = sorted((run_dir / "parts").glob("replica-*.jsonl"))
    records = (r for p in parts for r in iter_records(p))
    write_run_files(cfg, run_dir, records, read_errors(run_dir / ERRORS))
    append_slurm_record(run_dir, os.environ)


def sorted_lines(
    records: Iterable[Record], key: Callable[[Record], Any], spill_dir: str | Path, run_len: int = 4096
) -> Iterator[str]:
    """The records' results.jsonl lines sorted by ``key`` (stable), holding at most ``run_len``
    of them: longer inputs are sorted in runs spilled to files in ``spill_dir`` and merged (a
    100,000-record job's results are not held at once). Each record is serialized once: a
    spilled line carries its key (JSON, then a tab: ``json.dumps`` escapes every tab inside a
    record) and is merged by it without parsing the record again (that second parse and
    serialization were a large share of a large job's finalize: docs/notebook.md, "Measurements
    behind the code's choices"). The spilled files are removed when the merge ends. ``key`` must
    return JSON values that compare as they do after a round trip."""
    runs: list[Path] = []
    buf: list[tuple[Any, str]] = []

    def spill() -> None:
        path = Path(spill_dir) / f".sort-run-{len(runs)}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for k, line in sorted(buf, key=itemgetter(0)):
                f.write(json.dumps(k) + "\t" + line)
        runs.append(path)
        buf.clear()

    def spilled(path: Path) -> Iterator[tuple[Any, str]]:
        with open(path, encoding="utf-8", newline="\n") as f:
            for raw in f:
                k, _, line = raw.partition("\t")
                yield json.loads(k), line

    for r in records:
        buf.append((list(key(r)), r.to_line()))
        if len(buf) == run_len:
            spill()
    if not runs:
        yield from (line for _, line in sorted(buf, key=itemgetter(0)))
        return
    if buf:
        spill()
    try:
        # ties keep their run's order, and runs are in input order: stable, as sorted() is
        yield from (line for _, line in heapq.merge(*(spilled(p) for p in runs), key=itemgetter(0)))
    finally:
        for p in runs:
            p.unlink(missing_ok=True)


def place(r: Record) -> tuple:
    """A record's place in results.jsonl: warm-ups first, then by row, then in job order
    (records older than ``position`` sort by job order alone)."""
    return (r.warmup is not True, r.position if r.position is not None else -1, r.seq)


def write_run_files(cfg: AppConfig, run_dir: Path, records: Iterable[Record], errors: list[dict]) -> None:
    """results.jsonl (``place`` order), the ``run.output_format`` file, summary.json,
    benchmark.json and the printed table, from ``records`` in any order (a run's parts, or an
    array's shards: pipespec_mpi/run/shards.py) and ``errors`` (errors.jsonl's rows). The other
    files come from one pass over results.jsonl, read back as a stream."""
    with open(run_dir / RESULTS, "w", encoding="utf-8") as f:
        f.writelines(sorted_lines(records, place, run_dir))
    benchmark = cfg.run.mode == "benchmark"
    totals = metrics.Totals(per_prompt=benchmark)

    def results() -> Iterator[Record]:  # read once: the output file and the aggregates together
        for r in iter_records(run_dir / RESULTS):
            totals.add(r)
            yield r

    stream = results()
    write_outputs(cfg.run.output_format, run_dir, stream, errors, cfg.hierarchy.stages[-1].name)
    for _ in stream:  # what the output file did not read (jsonl: it is results.jsonl itself)
        pass
    summary = totals.summary()
    for s in summary.values():
        s.rows_not_decoded = len(errors)
    write_summary(run_dir / SUMMARY, summary)
    if benchmark:
        bench = totals.benchmark(cfg.run.methods)
        write_benchmark(run_dir / BENCHMARK, bench)
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
    if errors:
        print(f"[pipespec_mpi] {len(errors)} row(s) not decoded: {run_dir / ERRORS}", flush=True)
    print(f"[pipespec_mpi] results in {run_dir}", flush=True)


BENCHMARK_COLUMNS = (
    Column("method"), Column("ms/token", True), Column("tokens/s", True), Column("speedup", True),
    Column("median", True), Column("min", True), Column("max", True), Column("seq p50", True),
    Column("seq p90", True),
)  # fmt: skip


def format_benchmark(bench: Mapping[str, BenchmarkRow]) -> str:
    """The printed table: throughput (ms/token = 1000 / tokens/s), the speedup over AR at the
    same batch size and its per-prompt spread, and each sequence's own ms/token (p50, p90)."""
    rows = []
    for m, row in bench.items():
        pp = row.speedup_per_prompt
        seq = row.sequence_ms_per_token
        rows.append([
            m, f"{row.ms_per_token:.2f}", f"{row.tokens_per_s:.1f}", cell(row.speedup, ".2f"),
            cell(pp and pp.median, ".2f"), cell(pp and pp.min, ".2f"), cell(pp and pp.max, ".2f"),
            cell(seq.get("p50"), ".2f"), cell(seq.get("p90"), ".2f"),
        ])  # fmt: skip
    notes = ["speedup: over AR at the same batch size (median, min, max: per prompt); seq: each "
             "sequence's own ms/token"]  # fmt: skip
    return table.text(BENCHMARK_COLUMNS, rows, notes)
