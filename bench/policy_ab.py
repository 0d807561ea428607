"""PipeSpec's decision policies against each other on this node: alternating benchmark runs.

    .venv/bin/python bench/policy_ab.py [--datasets humaneval news] [--repeats 2] [--tokens 96]
        [--seed 7] [--prompts 4] [--ranks 3] [--arm static=decode.policy=static ...]
        [--background] [-- EXTRA HYDRA OVERRIDES]

Each arm is a name and its Hydra overrides (comma-separated); the default arms are the static
policy and the adaptive one. For every repeat and dataset the arms run one after another
(``run.mode=benchmark``: AR, SD and PipeSpec interleaved prompt by prompt after a warm-up prompt),
so each arm's speedups are ratios inside its own run (this machine's speed drifts by up to 2x
between runs) and the arms alternate in time. ``--background`` runs one niced busy process beside
every run (the contention case). Prints one line per run and a markdown table of the means, with
the machine, and writes every run's row as JSON lines to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("static=decode.policy=static", "adaptive=decode.policy=adaptive")


def cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return platform.processor()
    model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in out.splitlines() if ln.startswith("Flags")), [])
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return f"{model}, {os.cpu_count()} cores, {'+'.join(isa)}"


def run(overrides: list[str], ranks: int, run_dir: Path) -> dict:
    mpirun = str(Path(sys.executable).parent / "mpirun")
    cmd = [mpirun, "-n", str(ranks), sys.executable, "-m", "pipespec_mpi", "run.mode=benchmark",
           "run.progress=false", f"hydra.run.dir={run_dir}", *overrides]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    ar, sd, ps = (summary[m] for m in ("ar", "sd", "pipespec"))
    tgt = ps["stages"][-1]
    mid = ps["stages"][1] if len(ps["stages"]) > 2 else None
    return {
        "ar_ms": ar["ms_per_token"],
        "sd_x_ar": ar["ms_per_token"] / sd["ms_per_token"],
        "ps_x_ar": ar["ms_per_token"] / ps["ms_per_token"],
        "ps_x_sd": sd["ms_per_token"] / ps["ms_per_token"],
        "target_tokens_per_forward": tgt["tokens_per_forward"],
        "target_own_share": tgt["own_steps"] / tgt["forward_calls"] if tgt["forward_calls"] else 0.0,
        "sd_target_tokens_per_forward": sd["stages"][-1]["tokens_per_forward"],
        "middle_verifying_share": mid["proposals_per_forward"] if mid else None,
        "waits_cut_held": [[s["waits_chosen"], s["verify_cut"], s["drafts_held"]] for s in ps["stages"]],
        "identical": identical(run_dir),
    }


def identical(run_dir: Path) -> bool:
    """Greedy: every method's output of a prompt is the same (the target's own)."""
    by_prompt: dict[str, set[str]] = {}
    with open(run_dir / "results.jsonl", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            by_prompt.setdefault(str(r.get("prompt_id", r["seq"])), set()).add(json.dumps(r["output_ids"]))
    return all(len(v) == 1 for v in by_prompt.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--datasets", nargs="+", default=["humaneval", "news"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--arm", action="append", help="NAME=override[,override...] (repeatable)")
    ap.add_argument("--background", action="store_true", help="one niced busy process beside every run")
    ap.add_argument("--out", default="policy_ab.jsonl")
    ap.add_argument("extra", nargs="*", help="Hydra overrides for every run")
    a = ap.parse_args()
    arms = [(x.split("=", 1)[0], x.split("=", 1)[1].split(",")) for x in (a.arm or ARMS)]
    print(f"machine: {cpu()}; {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    busy = None
    if a.background:
        busy = subprocess.Popen(["nice", "-n", "10", sys.executable, "-c", "while True: pass"])
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp, open(a.out, "w", encoding="utf-8") as out:
            for rep in range(a.repeats):
                for ds in a.datasets:
                    for name, over in arms:
                        run_dir = Path(tmp) / f"{rep}-{ds}-{name}"
                        overrides = [f"dataset={ds}", f"dataset.seed={a.seed}",
                                     f"dataset.n_prompts={a.prompts}", f"decode.max_new_tokens={a.tokens}",
                                     *over, *a.extra]  # fmt: skip
                        row = {"repeat": rep, "dataset": ds, "arm": name, **run(overrides, a.ranks, run_dir)}
                        rows.append(row)
                        out.write(json.dumps(row) + "\n")
                        out.flush()
                        print(json.dumps(row), flush=True)
    finally:
        if busy is not None:
            busy.kill()
    print("\n| prompts | arm | runs | AR ms/tok | SD x AR | PipeSpec x AR | PipeSpec x SD |"
          " target tokens/forward (SD) | target own steps | outputs identical |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for ds in a.datasets:
        for name, _ in arms:
            rs = [r for r in rows if r["dataset"] == ds and r["arm"] == name]

            def mean(key: str, rs: list[dict] = rs) -> float:
                return sum(r[key] for r in rs) / len(rs)

            print(f"| {ds} | {name} | {len(rs)} | {mean('ar_ms'):.1f} | {mean('sd_x_ar'):.2f}x | "
                  f"{mean('ps_x_ar'):.2f}x | {mean('ps_x_sd'):.2f}x | "
                  f"{mean('target_tokens_per_forward'):.2f} ({mean('sd_target_tokens_per_forward'):.2f}) | "
                  f"{100 * mean('target_own_share'):.0f}% | "
                  f"{all(r['identical'] for r in rs)} |")  # fmt: skip


if __name__ == "__main__":
    main()
