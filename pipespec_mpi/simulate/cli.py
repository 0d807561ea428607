"""The simulator's command line (docs/simulator.md).

pipespec-simulate --preset paper [--json]
pipespec-simulate --from RUN_DIR [--json]
pipespec-simulate --fit RUN_DIR [RUN_DIR ...] [--plot OUT.png]
pipespec-simulate --fit-paper-rates
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from pipespec_mpi.config import POLICIES, DecodeConfig
from pipespec_mpi.errors import tool_error
from pipespec_mpi.simulate.fit import load_records, predict_run
from pipespec_mpi.simulate.paper import (
    PAPER_PIPESPEC_LOOKAHEAD,
    PAPER_SD_WINDOW,
    PAPER_TABLE,
    PaperSetting,
    fit_paper_rates,
    paper_rows,
)


def format_paper_table(rows: Sequence[dict]) -> str:
    lines = [
        f"{'method':<9} {'models':<16} {'ms/token':>9} {'speedup':>8}   "
        f"{'paper ms/token':>14} {'paper speedup':>13}"
    ]
    ar = PAPER_TABLE[("ar", ("70B",))]
    for r in rows:
        p = PAPER_TABLE.get((r["method"], tuple(r["models"])))
        ps = f"{p:>14.2f} {ar / p:>12.2f}x" if p else f"{'-':>14} {'-':>13}"
        lines.append(
            f"{r['method']:<9} {' -> '.join(r['models']):<16} {r['ms_per_token']:>9.2f} "
            f"{r['speedup']:>7.2f}x   {ps}"
        )
    return "\n".join(lines)


def format_run_table(res: Mapping[str, Mapping], run_dir: str) -> str:
    lines = [
        f"run {run_dir}",
        f"{'method':<9} {'prompts':>7} {'tokens':>7} {'measured':>9} {'predicted':>10} {'error':>7}"
        f"   acceptance / latency ms (down, up) / overhead ms per stage",
    ]
    for m, r in res.items():
        extra = ""
        if "acceptance" in r:
            extra = (
                f"   {[round(x, 3) for x in r['acceptance']]} / "
                f"{[round(x, 2) for x in r['latency_ms']]}, {[round(x, 2) for x in r['up_latency_ms']]}"
                f" / {[round(x, 2) for x in r['overhead_ms']]}"
            )
        lines.append(
            f"{m:<9} {r['n_prompts']:>7} {r['n_tokens']:>7} {r['measured_ms_per_token']:>9.2f} "
            f"{r['predicted_ms_per_token']:>10.2f} {100 * r['error']:>+6.1f}%{extra}"
        )
    return "\n".join(lines)


def fit_rows(run_dirs: Sequence[str | Path], **kw) -> list[dict]:
    """One row per (run, method): measured and predicted ms/token."""
    rows = []
    for d in run_dirs:
        recs = load_records(d)
        hier = (recs[0].hierarchy or f"{len(recs[0].stages)} stages") if recs else "?"
        look = sorted({r.window or 0 for r in recs if r.method != "ar"})
        tokens = max((r.max_new_tokens for r in recs), default=0)
        for m, r in predict_run(d, **kw).items():
            rows.append({"run": Path(d).name, "hierarchy": hier, "window": look, "max_new_tokens": tokens,
                         "method": m, **r})  # fmt: skip
    return rows


def format_fit_markdown(rows: Sequence[dict]) -> str:
    lines = [
        "| run | hierarchy | window | tokens/prompt | method | prompts | measured ms/token "
        "| predicted ms/token | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        look = ",".join(map(str, r["window"])) if r["method"] != "ar" else "-"
        lines.append(
            f"| {r['run']} | {r['hierarchy']} | {look} | {r['max_new_tokens']} | {r['method']} | "
            f"{r['n_prompts']} | {r['measured_ms_per_token']:.2f} | {r['predicted_ms_per_token']:.2f} | "
            f"{100 * r['error']:+.1f}% |"
        )
    return "\n".join(lines)


def paper_setting(a: argparse.Namespace) -> PaperSetting:
    """The paper's setting as the command line adjusts it (the defaults: ``PaperSetting``)."""
    cap = a.max_run_ahead or PaperSetting.max_run_ahead
    return PaperSetting(
        seeds=tuple(range(max(1, a.seeds))), max_run_ahead=cap, max_verify=a.max_verify or cap,
        acceptance=a.acceptance, blocking_reads=a.blocking_reads, draft_survival=a.draft_survival,
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="pipespec-simulate",
        description="Discrete-event simulator of AR, SD and PipeSpec (docs/simulator.md).",
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=["paper"], help="the paper's setting (Llama 3, A100s)")
    src.add_argument("--from", dest="run_dir", help="a run directory: predict its ms/token")
    src.add_argument("--fit-paper-rates", action="store_true", help="re-derive PAPER_RATES (slow: ~1 min)")
    src.add_argument(
        "--fit",
        "--calibration",
        dest="fit",
        nargs="+",
        metavar="RUN_DIR",
        help="runs: the simulator fitted to each, predicted vs measured (a markdown table)",
    )
    ap.add_argument("--plot", help="with --fit: write predicted vs measured to this PNG")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    ap.add_argument("--acceptance", choices=["trace", "iid"], default="trace",
                    help="paper: replay the authors' acceptance traces, or i.i.d. rates")  # fmt: skip
    ap.add_argument("--seeds", type=int, default=len(PaperSetting.seeds), help="paper: simulations per row")
    ap.add_argument("--lookahead", type=int, default=PAPER_PIPESPEC_LOOKAHEAD,
                    help="paper: PipeSpec lookahead")  # fmt: skip
    ap.add_argument("--sd-window", type=int, default=PAPER_SD_WINDOW, help="paper: SD window")
    ap.add_argument("--policy", choices=list(POLICIES), default="static",
                    help="paper: PipeSpec's decisions (decode.policy; static: --lookahead)")  # fmt: skip
    ap.add_argument("--draft-survival", type=float, default=0.0,
                    help="paper, adaptive: decode.draft_survival (0: up to the bound)")  # fmt: skip
    ap.add_argument("--blocking-reads", action="store_true",
                    help="header reads wait for a computing stage (the RMA epochs window, "
                         "run.epochs_window=rma): paper: simulate it; runs: records made so")  # fmt: skip
    ap.add_argument("--max-run-ahead", type=int, default=None,
                    help="default: 64 for the paper (uncapped reference); runs: each record's own, "
                         "else decode.max_run_ahead's default")  # fmt: skip
    ap.add_argument("--max-verify", type=int, default=None,
                    help="default: as --max-run-ahead for the paper; runs: each record's own, "
                         "else decode.max_verify's default")  # fmt: skip
    ap.add_argument("--scope", choices=["method", "record"], default="method",
                    help="runs: one fit per method, or per record")  # fmt: skip
    ap.add_argument("--iid", action="store_true",
                    help="runs: i.i.d. acceptance instead of the records' traces")  # fmt: skip
    a = ap.parse_args(argv)
    try:
        if a.fit_paper_rates:
            rates = fit_paper_rates(a.acceptance, lookahead=a.lookahead)
            out = {f"{x} -> {y}": v for (x, y), v in rates.items()}
            print(json.dumps(out, indent=2) if a.json else out)
            return 0
        if a.preset:
            rows = paper_rows(
                paper_setting(a), sd_window=a.sd_window, pipespec_lookahead=a.lookahead, policy=a.policy
            )
            print(json.dumps(rows, indent=2) if a.json else format_paper_table(rows))
            return 0
        caps = {"max_run_ahead": a.max_run_ahead or DecodeConfig.max_run_ahead,
                "max_verify": a.max_verify or DecodeConfig.max_verify}  # fmt: skip
        if a.fit:
            rows = fit_rows(a.fit, scope=a.scope, use_traces=not a.iid,
                                    blocking_reads=a.blocking_reads, **caps)  # fmt: skip
            print(json.dumps(rows, indent=2) if a.json else format_fit_markdown(rows))
            if a.plot:
                from pipespec_mpi.analysis.plots import simulator_fit

                simulator_fit(rows, a.plot)
            return 0
        res = predict_run(
            a.run_dir,
            scope=a.scope,
            use_traces=not a.iid,
            blocking_reads=a.blocking_reads,
            **caps,
        )
    except (OSError, ValueError, KeyError) as err:
        return tool_error(ap.prog, err)
    if a.json:
        out = {
            m: {k: r[k] for k in ("measured_ms_per_token", "predicted_ms_per_token")} for m, r in res.items()
        }
        print(json.dumps(out, indent=2))
    else:
        print(format_run_table(res, a.run_dir))
    return 0
