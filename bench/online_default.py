"""The command a user runs first against the fixed choices, job by job, alternated.

    .venv/bin/python bench/online_default.py [--rounds 3] [--prompts 16] [--tokens 96] [--seed 7]
        [--datasets humaneval,news] [--batch 1] [--out FILE]

Per dataset and round, one job each, in turn (A B C D A B C D, so drift hits all alike), on the
same held-out prompts (``dataset.seed``), greedy:
  default   ``mpirun -n 3 python -m pipespec_mpi`` (method=online over the three stages)
  auto      ``mpirun -n 3 python -m pipespec_mpi hierarchy=auto``
  suffix    ``mpirun -n 2 ... hierarchy=smollm2_suffix method=pipespec`` (the best fixed choice here)
  ar        ``mpirun -n 2 ... hierarchy=smollm2_suffix method=ar`` (the target alone, both cores)
The online plan's and auto's cache is empty at the first round (``--cache``), so round 1 is a first
job on the node and later rounds start from what earlier ones measured. Prints each job's ms/token
(its records' walls over their tokens, summary.json), its ratio to AR (and the median of the
prompts' own ratios) and to the best job of its round, and checks every job's outputs equal AR's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from stale_cache import machine  # bench/: the machine and commit a table is labelled with

ROOT = Path(__file__).resolve().parents[1]
JOBS = {
    "default": (3, []),
    "auto": (3, ["hierarchy=auto"]),
    "suffix": (2, ["hierarchy=smollm2_suffix", "method=pipespec"]),
    "ar": (2, ["hierarchy=smollm2_suffix", "method=ar"]),
}


def job(name: str, run_dir: Path, common: list[str], env: dict) -> dict:
    n, overrides = JOBS[name]
    cmd = [str(ROOT / ".venv/bin/mpirun"), "-n", str(n), sys.executable, "-m", "pipespec_mpi",
           f"hydra.run.dir={run_dir}", "run.progress=false", *common, *overrides]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = json.loads((run_dir / "summary.json").read_text())
    entry = next(iter(summary.values()))
    outs, ms = {}, {}
    for line in (run_dir / "results.jsonl").read_text().splitlines():
        r = json.loads(line)
        if not r["warmup"]:
            outs[r["prompt_id"]] = r["output_ids"]
            ms[r["prompt_id"]] = r["ms_per_token"]
    row = {"ms_per_token": entry["ms_per_token"], "outputs": outs, "per_prompt": ms}
    online = run_dir / "online.json"
    if online.exists():
        row["online"] = json.loads(online.read_text())
    plan = run_dir / "plan.json"
    if plan.exists():
        p = json.loads(plan.read_text())
        row["plan"] = {"runs": p.get("runs"), "calibration_s": p.get("calibration_s"),
                       "online_vs_predicted": p.get("online_vs_predicted", {}),
                       "refit_used": (p.get("inputs") or {}).get("refit", [])}  # fmt: skip
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--datasets", default="humaneval,news")
    ap.add_argument("--jobs", default=",".join(JOBS))
    ap.add_argument("--cache", default=None, help="the cache directory (default: a fresh one)")
    ap.add_argument("--out", default=None, help="a JSON file for every job's numbers")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="online_default_"))
    env = {**os.environ, "PIPESPEC_CACHE_DIR": args.cache or str(work / "cache"),
           "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}  # fmt: skip
    print(machine(), flush=True)
    names = args.jobs.split(",")
    report = []
    for ds in args.datasets.split(","):
        common = [f"dataset={ds}", f"dataset.seed={args.seed}", f"dataset.n_prompts={args.prompts}",
                  "dataset.shuffle=true", f"decode.max_new_tokens={args.tokens}",
                  f"decode.batch_size={args.batch}"]  # fmt: skip
        for rnd in range(1, args.rounds + 1):
            rows = {name: job(name, work / f"{ds}-{rnd}-{name}", common, env) for name in names}
            ref = rows.get("ar", next(iter(rows.values())))["outputs"]
            best = min(r["ms_per_token"] for r in rows.values())
            for name, r in rows.items():
                same = r["outputs"] == ref
                line = f"{ds} round {rnd} {name:8s} {r['ms_per_token']:7.2f} ms/token"
                if "ar" in rows:
                    ar = rows["ar"]
                    paired = statistics.median(
                        ar["per_prompt"][p] / r["per_prompt"][p] for p in r["per_prompt"]
                    )
                    line += f"  x AR {ar['ms_per_token'] / r['ms_per_token']:.2f} (per prompt: {paired:.2f})"
                line += f"  x best {best / r['ms_per_token']:.2f}  outputs {'= AR' if same else 'DIFFER'}"
                if "online" in r:
                    o = r["online"][str(args.batch)]
                    line += f"  [{o['current']}; runs {o['runs']}]"
                if "plan" in r and r["plan"]["runs"]:
                    line += f"  [auto runs {r['plan']['runs'].get('hierarchy')}]"
                    vs = r["plan"]["online_vs_predicted"]
                    if vs:  # the offline plan's predictions (refit by earlier jobs) against this job
                        ratios = [f"{k} {v['measured'] / v['predicted']:.2f}"
                                  for k, v in vs.items() if v["predicted"]]  # fmt: skip
                        used = len(r["plan"]["refit_used"])
                        line += f"  [measured/predicted: {', '.join(ratios)}; refit from {used} ratios]"
                print(line, flush=True)
                kept = {k: v for k, v in r.items() if k != "outputs"}
                report.append({"dataset": ds, "round": rnd, "job": name, **kept, "outputs_equal_ar": same})
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine(), "jobs": report}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
