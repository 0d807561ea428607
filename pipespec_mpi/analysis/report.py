"""Compare runs: one table across run directories (like the paper's Table 2) plus PNG plots.

    pipespec-report RUN_DIR [RUN_DIR ...] [--json | --markdown] [--no-plots]

A RUN_DIR holds ``results.jsonl`` (one record per prompt and method); a Hydra multirun directory
(numbered subfolders that are run dirs) stands for all its runs. One table row per (run, method):
ms/token and tokens/s over the non-warm-up records, speedup over the AR decoding of the same
target model (from the same run dir when it has one, else pooled from the other run dirs given,
marked ``*``), and mean accepted tokens per verification for every adjacent stage pair.

Plots (``pipespec_mpi.analysis.plots``), written next to the data:
  in each run dir     accepted_hist.png (paper Fig. 3), timeline.png (Figs. 2/5),
                      busy_fraction.png
  cross-run (the multirun dir, else the run dirs' common parent, or ``--out``):
                      busy_fraction.png, and speedup_vs_lookahead.png when the runs sweep
                      ``lookahead`` (paper Fig. 4)

All numbers come from ``pipespec_mpi.analysis.metrics`` (``summarize``, ``benchmark_table``); this module
only groups records, picks the AR reference and formats.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from pipespec_mpi.analysis import metrics, table
from pipespec_mpi.analysis.runs import (
    ReportError,
    Run,
    cross_run_dir,
    find_runs,
)
from pipespec_mpi.analysis.table import Column, cell
from pipespec_mpi.errors import tool_error
from pipespec_mpi.records import Record, RecordError

METHOD_ORDER = {"ar": 0, "sd": 1, "pipespec": 2}


# --------------------------------------------------------------------------------------------
# the table


def method_order(method: str, batch_size: int) -> tuple:
    """Order of a run's rows: by method (AR, SD, PipeSpec), then batch size."""
    return (METHOD_ORDER.get(method, len(METHOD_ORDER)), method, batch_size)


def target_of(records: Sequence[Record]) -> str:
    return records[0].models[-1]


def ar_reference(
    run: Run, runs: Sequence[Run], target: str, batch_size: int = 1
) -> tuple[list[Record], list[Run]]:
    """AR records of ``target`` at ``batch_size`` for speedups: the run's own, else those of the
    other runs (preferring runs over the same prompts and token budget), pooled."""

    def ar(recs: list[Record]) -> list[Record]:
        return [r for r in recs if r.method == "ar" and r.models[-1] == target and r.batch_size == batch_size]

    own = ar(run.measured)
    if own:
        return own, [run]
    cands = []
    for other in runs:
        if other is run:
            continue
        recs = ar(other.measured)
        if recs:
            cands.append((other, recs))
    if not cands:
        return [], []

    def same_workload(recs: list[Record]) -> bool:
        mine = run.measured
        return {r.prompt_id for r in recs} == {r.prompt_id for r in mine} and {
            r.max_new_tokens for r in recs
        } == {r.max_new_tokens for r in mine}

    best = [(o, recs) for o, recs in cands if same_workload(recs)] or cands
    return [r for _, recs in best for r in recs], [o for o, _ in best]


def table_rows(runs: Sequence[Run]) -> list[dict]:
    """One row per (run, method, batch size), sorted by target model, method, models, window
    and batch size; a batched row's speedup is over AR at the same batch size."""
    rows = []
    for i, run in enumerate(runs):
        recs = run.measured
        if not recs:
            print(f"[report] {run.path}: no measured (non-warm-up) records", file=sys.stderr)
            continue
        summary = metrics.summarize(recs)
        for key, s in sorted(summary.items(), key=lambda kv: method_order(kv[1].method, kv[1].batch_size)):
            m, b = s.method, s.batch_size
            mine = [r for r in recs if (r.method, r.batch_size) == (m, b)]
            target = target_of(mine)
            if m == "ar":
                ref, ref_runs = mine, [run]
            else:
                ref, ref_runs = ar_reference(run, runs, target, b)
            # benchmark_table pairs the method with AR (aggregate and per-prompt ratios)
            bench = metrics.benchmark_table(mine if m == "ar" else mine + ref, [m])[key]
            first = mine[0]
            acc = s.acceptance
            per_prompt = bench.speedup_per_prompt
            rows.append({
                "run": run.label,
                "run_dir": str(run.path),
                "run_index": i,
                "method": m,
                "batch_size": b,
                "hierarchy": first.hierarchy,
                "models": [target] if m == "ar" else list(first.models),
                "stage_models": list(first.models),
                "target": target,
                "window": None if m == "ar" else first.window,
                "max_new_tokens": first.max_new_tokens,
                "transport": first.transport,
                "dataset": run.config.dataset.name if run.config else None,
                "overrides": run.overrides,
                "n_prompts": s.n_prompts,
                "n_tokens": s.n_tokens,
                "wall_s": s.wall_s,
                "ms_per_token": s.ms_per_token,
                "tokens_per_s": s.tokens_per_s,
                "speedup": bench.speedup,
                "speedup_ref": (
                    None if not ref_runs
                    else "same run" if ref_runs == [run]
                    else [o.label for o in ref_runs]
                ),
                "speedup_per_prompt": asdict(per_prompt) if per_prompt is not None else None,
                "mean_accepted_per_verification": {
                    k: (v.mean_accepted if v.verifications else None) for k, v in acc.items()
                },
                "verifications": {k: v.verifications for k, v in acc.items()},
                "acceptance_rate": {
                    k: (v.acceptance_rate if v.proposed else None) for k, v in acc.items()
                },
                "busy_fraction": [st.busy_fraction for st in s.stages],
                "cpu_cores": [st.cpu_cores for st in s.stages],
                "proposals_per_forward": (
                    {} if m == "ar" else {i: st.proposals_per_forward for i, st in enumerate(s.stages) if i}
                ),
                "tokens_per_target_forward": s.stages[-1].tokens_per_forward,
                "policy": "-" if m == "ar" else first.policy,
                "policy_actions": {
                    i: {"waits": st.waits_chosen, "joined": st.waits_joined, "cut": st.verify_cut,
                        "held": st.drafts_held}
                    for i, st in enumerate(s.stages)
                    if st.waits_chosen or st.waits_joined or st.verify_cut or st.drafts_held
                },
                "drafter": s.stages[0].drafter,
                "ttft_s_mean": s.ttft_s_mean,
                "token_latency_ms": s.token_latency_ms,
                "sequence_ms_per_token": s.sequence_ms_per_token,
            })  # fmt: skip
    rows.sort(
        key=lambda r: (
            r["target"],
            method_order(r["method"], 1),
            len(r["models"]),
            r["models"],
            -1 if r["window"] is None else r["window"],
            r["batch_size"],
            r["run_index"],
        )
    )
    return rows


def _cells(row: dict) -> list[str]:
    acc = row["mean_accepted_per_verification"]
    speed = cell(row["speedup"], ".2f")
    if row["speedup"] is not None and row["speedup_ref"] != "same run":
        speed += "*"
    return [
        row["run"],
        row["method"],
        " > ".join(row["models"]),
        cell(row["window"], "d"),
        str(row["batch_size"]),
        str(row["n_prompts"]),
        str(row["n_tokens"]),
        f"{row['ms_per_token']:.2f}",
        f"{row['tokens_per_s']:.1f}",
        speed,
        ", ".join(f"{k} {cell(v, '.2f')}" for k, v in acc.items()) if row["method"] != "ar" else "-",
        ", ".join(f"{k} {v:.2f}" for k, v in row["proposals_per_forward"].items()) or "-",
        f"{row['tokens_per_target_forward']:.2f}",
        ", ".join(f"{k} {v['mean_accepted']:.2f}" for k, v in row["drafter"].items()) or "-",
        row["policy"],
        ", ".join(
            f"{i} {a['waits']}/{a['joined']}/{a['cut']}/{a['held']}" for i, a in row["policy_actions"].items()
        )
        or "-",
        "/".join(cell(c, ".2f") for c in row["cpu_cores"])
        if any(c is not None for c in row["cpu_cores"])
        else "-",
    ]


TITLES = ("run", "method", "models", "window", "batch", "prompts", "tokens", "ms/token", "tokens/s",
          "speedup", "accepted/verification", "proposals/forward", "tokens/target forward",
          "drafter accepted/proposal", "policy", "waits/joined/cut/held", "cores busy")  # fmt: skip
NUMBERS = {"window", "batch", "prompts", "tokens", "ms/token", "tokens/s", "speedup", "tokens/target forward"}
COLUMNS = [Column(t, right=t in NUMBERS) for t in TITLES]


def _footnotes(rows: Sequence[dict]) -> list[str]:
    notes = ["speedup: AR ms/token of the same target model at the same batch size / the row's ms/token",
             "batched rows: ms/token is the phase's time over its tokens (1000 / tokens/s)"]  # fmt: skip
    if any(r["speedup"] is not None and r["speedup_ref"] != "same run" for r in rows):
        notes.append("* AR reference taken from other run dirs: see --json speedup_ref")
    if any(r["speedup"] is None for r in rows):
        notes.append("- no AR run of that target model among the runs given")
    notes.append("accepted/verification: mean draft tokens accepted per verification, per pair")
    notes.append("proposals/forward: per verifying stage, the share of its forwards that verified a proposal")
    notes.append("tokens/target forward: tokens the last stage committed per forward (AR: 1)")
    if any(r["policy_actions"] for r in rows):
        notes.append(
            "waits/joined/cut/held: per stage, what decode.policy=adaptive chose: waits for more "
            "proposals although it could act, those given up to join a batched forward of the other "
            "slots, verifications cut short of what was pending, drafting held back"
        )
    if any(r["drafter"] for r in rows):
        notes.append("drafter accepted/proposal: a suffix stage 0's tokens accepted per proposal, per source")
    if any(c is not None for r in rows for c in r["cpu_cores"]):
        notes.append(
            "cores busy: per stage, its rank's CPU time (every thread, computing or waiting) over the "
            "time it spent on the records; - where it had no part (a drafter in AR at batch 1)"
        )
    return notes


def format_table(rows: Sequence[dict], md: bool = False) -> str:
    return table.render(COLUMNS, [_cells(r) for r in rows], _footnotes(rows), md=md)


def format_runs(runs: Sequence[Run]) -> str:
    lines = ["runs:"]
    for r in runs:
        ov = " ".join(r.overrides)
        lines.append(f"  {r.label}: {r.path}" + (f"  [{ov}]" if ov else ""))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# data for the plots


def lookahead_sweeps(rows: Sequence[dict]) -> dict[str, list[dict]]:
    """Rows of each (method, models) that ran at two or more lookaheads, keyed by a label."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["method"] != "ar" and r["window"] is not None and r["batch_size"] == 1:
            groups.setdefault((r["method"], tuple(r["models"])), []).append(r)
    return {
        f"{m} ({' > '.join(models)})": sorted(rs, key=lambda r: (r["window"], r["run_index"]))
        for (m, models), rs in groups.items()
        if len({r["window"] for r in rs}) >= 2
    }


def batch_sweeps(rows: Sequence[dict]) -> dict[str, list[dict]]:
    """Rows of each (method, models, run) at two or more batch sizes, keyed by a label."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["method"], tuple(r["models"]), r["run"]), []).append(r)
    many = len({r["run"] for r in rows}) > 1
    return {
        f"{m} ({' > '.join(models)})" + (f" [{run}]" if many else ""): sorted(
            rs, key=lambda r: r["batch_size"]
        )
        for (m, models, run), rs in groups.items()
        if len({r["batch_size"] for r in rs}) >= 2
    }


def ar_ms_per_token(runs: Sequence[Run]) -> dict[str, float]:
    """Pooled AR ms/token at batch 1 per target model over all the runs."""
    by_target: dict[str, list[Record]] = {}
    for run in runs:
        for r in run.measured:
            if r.method == "ar" and r.batch_size == 1:
                by_target.setdefault(r.models[-1], []).append(r)
    return {t: metrics.summarize(rs)["ar"].ms_per_token for t, rs in by_target.items()}


def timeline_records(run: Run, prompt_id: str | None = None) -> dict[str, Record]:
    """One record per method for one prompt: ``prompt_id``, else the first measured prompt
    that every method of the run decoded (warm-up records only if nothing else)."""
    pool = run.measured or run.records
    methods = sorted({r.method for r in pool}, key=lambda m: method_order(m, 1))
    if prompt_id is None:
        done: dict[str, set[str]] = {}
        for r in pool:
            done.setdefault(r.prompt_id, set()).add(r.method)
        full = [p for p, ms in done.items() if len(ms) == len(methods)]
        prompt_id = full[0] if full else pool[0].prompt_id if pool else None
    out: dict[str, Record] = {}
    for r in pool:
        if r.prompt_id == prompt_id and r.method not in out:
            out[r.method] = r
    return {m: out[m] for m in methods if m in out}


def write_plots(
    runs: Sequence[Run],
    rows: Sequence[dict],
    out: str | Path | None = None,
    prompt_id: str | None = None,
) -> list[Path]:
    """Every plot for these runs; returns the paths written."""
    from pipespec_mpi.analysis import plots

    written: list[Path | None] = []
    for i, run in enumerate(runs):
        recs = run.measured
        if not recs:
            continue
        summary = metrics.summarize(recs)
        mine = [r for r in rows if r["run_index"] == i]
        acc = {m: s.acceptance for m, s in summary.items() if m != "ar"}
        written.append(
            plots.accepted_histogram(acc, mine, f"run {run.label}", run.path / "accepted_hist.png")
        )
        tl = timeline_records(run, prompt_id)
        if tl:
            written.append(plots.timeline(tl, f"run {run.label}", run.path / "timeline.png"))
        written.append(plots.busy_fraction(mine, f"run {run.label}", run.path / "busy_fraction.png"))
        sweeps = batch_sweeps(mine)
        if sweeps:
            written.append(
                plots.throughput_vs_batch(sweeps, f"run {run.label}", run.path / "tokens_per_s_vs_batch.png")
            )
    cross = cross_run_dir(runs, out)
    if cross is None and len(runs) > 1:
        print("[report] cross-run plots skipped: the runs share no folder; use --out DIR",
              file=sys.stderr)  # fmt: skip
    if cross is not None:
        cross.mkdir(parents=True, exist_ok=True)
        written.append(plots.busy_fraction(rows, "all runs", cross / "busy_fraction.png"))
        sweeps = lookahead_sweeps(rows)
        if sweeps:
            written.append(
                plots.speedup_vs_lookahead(sweeps, ar_ms_per_token(runs), cross / "speedup_vs_lookahead.png")
            )
    return [p for p in written if p is not None]


# --------------------------------------------------------------------------------------------
# command line


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="pipespec-report",
        description="Compare PipeSpec runs: one table across run dirs, and PNG plots.",
    )
    ap.add_argument("run_dirs", nargs="+", help="run dirs, or Hydra multirun dirs")
    fmt = ap.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print the table rows as JSON")
    fmt.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    ap.add_argument("--no-plots", action="store_true", help="write no PNGs")
    ap.add_argument("--out", help="folder for cross-run plots (default: the multirun dir)")
    ap.add_argument("--prompt", help="prompt id for timeline.png (default: the first one)")
    args = ap.parse_args(argv)
    try:
        runs = find_runs(args.run_dirs)
    except (ReportError, RecordError, OSError) as err:
        return tool_error(ap.prog, err)
    rows = table_rows(runs)
    if args.json:
        print(json.dumps(rows, indent=2))
    elif args.markdown:
        print(format_table(rows, md=True))
    else:
        print(format_table(rows))
        print()
        print(format_runs(runs))
    if not args.no_plots:
        for p in write_plots(runs, rows, args.out, args.prompt):
            print(f"[report] wrote {p}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
