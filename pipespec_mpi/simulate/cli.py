"""The simulator's command line (docs/simulator.md).

pipespec-simulate --preset paper [decode.lookahead=1 decode.policy=adaptive ...] [--json | --markdown]
pipespec-simulate RUN_DIR [RUN_DIR ...] [--plot OUT.png] [--json | --markdown]
pipespec-simulate --fit-paper-rates

Settings are the app's own keys (``decode.*``, ``run.epochs_window``), checked as a job checks them.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from pipespec_mpi.analysis import table as layout
from pipespec_mpi.analysis.table import Column, cell
from pipespec_mpi.config import AppConfig, compose_tool_config, split_tool_args
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


def format_paper_table(rows: Sequence[dict], md: bool = False) -> str:
    cols = [Column("method"), Column("models"), Column("ms/token", True), Column("speedup", True),
            Column("paper ms/token", True), Column("paper speedup", True)]  # fmt: skip
    ar = PAPER_TABLE[("ar", ("70B",))]
    cells = []
    for r in rows:
        p = PAPER_TABLE.get((r["method"], tuple(r["models"])))
        cells.append([r["method"], " -> ".join(r["models"]), f"{r['ms_per_token']:.2f}",
                      f"{r['speedup']:.2f}x", cell(p, ".2f"), f"{ar / p:.2f}x" if p else "-"])  # fmt: skip
    return layout.render(cols, cells, md=md)


def _rounded(xs: Sequence[float], digits: int) -> str:
    return "[" + ", ".join(f"{x:.{digits}f}" for x in xs) + "]"


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


def format_fit_table(rows: Sequence[dict], md: bool = False) -> str:
    """One row per (run, method): measured and predicted ms/token, and what was fitted (with
    ``--scope method``: acceptance, message latency down and up, loop overhead per stage)."""
    cols = [Column("run"), Column("hierarchy"), Column("window"), Column("tokens/prompt", True),
            Column("method"), Column("prompts", True), Column("measured ms/token", True),
            Column("predicted ms/token", True), Column("error", True), Column("acceptance per stage"),
            Column("latency ms down / up"), Column("overhead ms")]  # fmt: skip
    cells = []
    for r in rows:
        fitted = "acceptance" in r
        cells.append([
            r["run"], r["hierarchy"], ",".join(map(str, r["window"])) if r["method"] != "ar" else "-",
            str(r["max_new_tokens"]), r["method"], str(r["n_prompts"]), f"{r['measured_ms_per_token']:.2f}",
            f"{r['predicted_ms_per_token']:.2f}", f"{100 * r['error']:+.1f}%",
            _rounded(r["acceptance"], 3) if fitted else "-",
            f"{_rounded(r['latency_ms'], 2)} / {_rounded(r['up_latency_ms'], 2)}" if fitted else "-",
            _rounded(r["overhead_ms"], 2) if fitted else "-",
        ])  # fmt: skip
    return layout.render(cols, cells, md=md)


def profile_rows(path: str, setting: PaperSetting, batch_sizes: Sequence[int], sd_window: int,
                 lookahead: int) -> dict:  # fmt: skip
    """AR, SD and PipeSpec over the paper's hierarchies with a measured profile's forward costs
    and the paper's acceptance, at each batch size."""
    from dataclasses import replace

    from pipespec_mpi.simulate.profile import profiles_from

    doc = json.loads(Path(path).read_text())
    profiles, source = profiles_from(doc)
    rows = []
    for b in batch_sizes:
        for r in paper_rows(replace(setting, profiles=profiles, batch_size=b), sd_window, lookahead):
            rows.append({**r, "batch_size": b, "tokens_per_s": 1000.0 * b / r["ms_per_token"]})
    return {
        "device": doc["device"],
        "dtype": doc["dtype"],
        "date": doc.get("date"),
        "models": source,
        "rows": rows,
    }


def format_profile_table(out: dict, md: bool = False) -> str:
    cols = [Column("batch", True), Column("method"), Column("models"), Column("ms/token/sequence", True),
            Column("tokens/s", True), Column("x AR", True)]  # fmt: skip
    cells = [[str(r["batch_size"]), r["method"], " -> ".join(r["models"]), f"{r['ms_per_token']:.2f}",
              f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}x"] for r in out["rows"]]  # fmt: skip
    head = f"{out['device']} ({out['dtype']}, {out['date']}); paper acceptance; " + "; ".join(
        f"{m}: {s}" for m, s in out["models"].items()
    )
    return head + "\n" + layout.render(cols, cells, md=md)


SETTINGS = ("decode", "run.epochs_window")  # the app's keys this tool reads (decode.*)


def paper_setting(a: argparse.Namespace, cfg: AppConfig, given: set[str]) -> PaperSetting:
    """The paper's setting as the overrides adjust it (unset keys: ``PaperSetting``'s values)."""
    d = cfg.decode
    cap = d.max_run_ahead if "decode.max_run_ahead" in given else PaperSetting.max_run_ahead
    return PaperSetting(
        seeds=tuple(range(max(1, a.seeds))), max_run_ahead=cap,
        max_verify=d.max_verify if "decode.max_verify" in given else cap, acceptance=a.acceptance,
        blocking_reads=cfg.run.epochs_window == "rma", draft_survival=d.draft_survival,
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="pipespec-simulate",
        description="Discrete-event simulator of AR, SD and PipeSpec (docs/simulator.md). Settings "
        "are the app's keys: decode.* (lookahead, sd_window, policy, draft_survival, "
        "max_run_ahead, max_verify) and run.epochs_window=rma (header reads that wait).",
    )
    ap.add_argument("args", nargs="*", metavar="RUN_DIR | KEY=VALUE",
                    help="run directories (each predicted against what it measured); settings")  # fmt: skip
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=["paper"], help="the paper's setting (Llama 3, A100s)")
    src.add_argument("--fit-paper-rates", action="store_true", help="re-derive PAPER_RATES (slow: ~1 min)")
    src.add_argument("--profile", metavar="FILE",
                     help="the paper's hierarchy with the forward costs a device measured "
                     "(python -m pipespec_mpi.simulate.profile; bench/gpu_check.sh)")  # fmt: skip
    ap.add_argument(
        "--batch-sizes", default="1,8", help="--profile: batch sizes to predict (comma-separated)"
    )
    ap.add_argument("--plot", help="runs: write predicted vs measured to this PNG")
    fmt = ap.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="machine-readable output")
    fmt.add_argument("--markdown", action="store_true", help="the table as Markdown")
    ap.add_argument("--acceptance", choices=["trace", "iid"], default="trace",
                    help="paper: replay the authors' acceptance traces, or i.i.d. rates")  # fmt: skip
    ap.add_argument("--seeds", type=int, default=len(PaperSetting.seeds), help="paper: simulations per row")
    ap.add_argument("--scope", choices=["method", "record"], default="method",
                    help="runs: one fit per method, or per record")  # fmt: skip
    ap.add_argument("--iid", action="store_true",
                    help="runs: i.i.d. acceptance instead of the records' traces")  # fmt: skip
    a = ap.parse_args(argv)
    run_dirs, settings = split_tool_args(a.args)
    if bool(run_dirs) + bool(a.preset) + a.fit_paper_rates + bool(a.profile) != 1:
        ap.error("give run directories, --preset paper, --profile FILE or --fit-paper-rates (one of them)")
    try:
        cfg, given = compose_tool_config(settings, SETTINGS)
        d = cfg.decode
        lookahead = d.lookahead if "decode.lookahead" in given else PAPER_PIPESPEC_LOOKAHEAD
        if a.fit_paper_rates:
            rates = fit_paper_rates(a.acceptance, lookahead=lookahead)
            out = {f"{x} -> {y}": v for (x, y), v in rates.items()}
            print(json.dumps(out, indent=2) if a.json else out)
            return 0
        if a.profile:
            sizes = [int(b) for b in a.batch_sizes.split(",")]
            setting = paper_setting(a, cfg, given)
            out = profile_rows(a.profile, setting, sizes, d.sd_window or PAPER_SD_WINDOW, lookahead)
            print(json.dumps(out, indent=2) if a.json else format_profile_table(out, a.markdown))
            return 0
        if a.preset:
            rows = paper_rows(
                paper_setting(a, cfg, given),
                sd_window=d.sd_window if "decode.sd_window" in given and d.sd_window else PAPER_SD_WINDOW,
                pipespec_lookahead=lookahead,
                policy=d.policy if "decode.policy" in given else "static",
            )
            print(json.dumps(rows, indent=2) if a.json else format_paper_table(rows, a.markdown))
            return 0
        rows = fit_rows(run_dirs, scope=a.scope, use_traces=not a.iid,
                        blocking_reads=cfg.run.epochs_window == "rma", max_run_ahead=d.max_run_ahead,
                        max_verify=d.max_verify)  # fmt: skip
    except (OSError, ValueError, KeyError) as err:
        return tool_error(ap.prog, err)
    print(json.dumps(rows, indent=2) if a.json else format_fit_table(rows, a.markdown))
    if a.plot:
        from pipespec_mpi.analysis.plots import simulator_fit

        simulator_fit(rows, a.plot)
    return 0
