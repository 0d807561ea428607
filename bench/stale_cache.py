"""hierarchy=auto's cache, measured beside a busy process, then reused on the quiet node.

    .venv/bin/python bench/stale_cache.py [--tokens 96] [--seed 7] [--prompts 4] [--out FILE]

1. ``hierarchy=auto`` with an empty cache while one busy process (an unniced spinning Python)
   shares the node: its costs are measured, and cached, slow.
2. With nothing else running, ``hierarchy=auto`` on held-out code (HumanEval) and prose (Lee news)
   prompts: the spot check should find the cached costs stale and measure again.
3. The default hierarchy (``hierarchy=smollm2``) on the same prompts.

Every job is ``run.mode=benchmark`` (AR and the methods interleaved prompt by prompt), so each
compares speedups over AR inside its own run: this machine's speed drifts by up to 2x between
runs. Prints, per job, the plan's spot check and choice, and every method's speedup; the best
auto speedup against the best of the default hierarchy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def machine() -> str:
    """The label of a table: CPU model, widest ISA, cores, Python, commit."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line), "?")
    flags = next((line for line in out.splitlines() if line.startswith("Flags")), "")
    widest = [("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2")]
    isa = next((name for flag, name in widest if flag in flags), "no AVX2")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    py = platform.python_version()
    return f"{model} ({isa}), {os.cpu_count()} cores, python {py}, commit {commit.stdout.strip()}"


def job(run_dir: Path, overrides: list[str], env: dict) -> dict:
    cmd = [str(ROOT / ".venv/bin/mpirun"), "-n", "3", sys.executable, "-m", "pipespec_mpi",
           "run.mode=benchmark", f"hydra.run.dir={run_dir}", *overrides]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    bench = json.loads((run_dir / "benchmark.json").read_text())
    row = {"speedup": {m: round(r["speedup"], 3) for m, r in bench.items() if "speedup" in r}}
    plan = run_dir / "plan.json"
    if plan.exists():
        p = json.loads(plan.read_text())
        row |= {"spot_check": p.get("spot_check"), "from_cache": p.get("from_cache"),
                "chosen": {k: p["chosen"][k] for k in ("method", "pipeline", "window", "run_ahead",
                                                       "policy")},
                "runs": p.get("runs"), "prediction_off": p.get("prediction_off"),
                "predicted": round(p["ar"]["ms_per_token"] / p["chosen"]["ms_per_token"], 2),
                "calibration_s": p.get("calibration_s")}  # fmt: skip
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--out", default=None, help="JSON lines of every job")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stale_cache_"))
    env = {**os.environ, "PIPESPEC_CACHE_DIR": str(work / "cache")}
    common = [f"dataset.seed={a.seed}", f"dataset.n_prompts={a.prompts}", f"decode.max_new_tokens={a.tokens}"]
    print(machine())
    rows = []

    def record(name: str, row: dict) -> None:
        row = {"job": name, **row}
        rows.append(row)
        print(json.dumps(row), flush=True)

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        record(
            "auto, code, busy node", job(work / "busy", ["hierarchy=auto", "dataset=humaneval", *common], env)
        )
    finally:
        busy.kill()
        busy.wait()
    for ds, name in (("humaneval", "code"), ("news", "prose")):
        record(
            f"auto, {name}, quiet",
            job(work / f"auto_{ds}", ["hierarchy=auto", f"dataset={ds}", *common], env),
        )
        record(f"smollm2, {name}, quiet",
               job(work / f"default_{ds}", ["hierarchy=smollm2", f"dataset={ds}", *common], env))  # fmt: skip
    for name in ("code", "prose"):
        auto = max(next(r for r in rows if r["job"] == f"auto, {name}, quiet")["speedup"].values())
        best = max(next(r for r in rows if r["job"] == f"smollm2, {name}, quiet")["speedup"].values())
        print(
            f"{name}: best auto {auto:.2f}x AR, best of the default hierarchy {best:.2f}x AR: "
            f"{auto / best:.3f}"
        )
    if a.out:
        Path(a.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
