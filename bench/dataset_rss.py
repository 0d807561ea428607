"""Peak RSS per rank of a dataset job, against the size of its file: it must not grow with it.

    .venv/bin/python bench/dataset_rss.py [--rows 10000 100000] [--ranks 3] [--tokens 2]
        [--hierarchy tiny] [--method pipespec]

For each row count, writes a JSONL file of that many synthetic rows (``dataset=synthetic``'s
word salad, one ``prompt`` per row, every 1000th row malformed so that errors.jsonl has lines
too), runs one job of the tiny hierarchy over it (``mpirun -n RANKS python -m pipespec_mpi
hierarchy=tiny dataset=files``, ``run.output_format=openai``), and reads each rank's peak RSS
from its log (``peak RSS of this rank``: ru_maxrss at the end, finalize included on rank 0).
Prints one line per row count (rows/s too) and a JSON summary at the end. Run it alone: the
job takes both cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the", "of", "model", "token", "draft", "verify", "stage", "pipeline", "cluster", "node", "rank")


def write_rows(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            if i % 1000 == 999:
                f.write("{not json\n")
            else:
                f.write(
                    json.dumps({"id": f"r{i}", "prompt": " ".join(rng.choice(WORDS) for _ in range(12))})
                    + "\n"
                )


def run_job(rows: Path, run_dir: Path, a: argparse.Namespace) -> float:
    mpirun = str(Path(sys.executable).parent / "mpirun")
    cmd = [mpirun, "-n", str(a.ranks), sys.executable, "-m", "pipespec_mpi", f"hierarchy={a.hierarchy}",
           f"method={a.method}", "dataset=files", f"dataset.path={rows}", f"decode.max_new_tokens={a.tokens}",
           "run.output_format=openai", "run.progress=false", f"hydra.run.dir={run_dir}"]  # fmt: skip
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"job failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return time.perf_counter() - t0


def peaks(run_dir: Path) -> list[float]:
    out = []
    for log in sorted(run_dir.glob("rank*.log"), key=lambda p: int(p.stem[4:])):
        found = re.findall(r"peak RSS of this rank: (\d+) MB", log.read_text())
        out.append(float(found[-1]) if found else float("nan"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[10000, 100000])
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2)
    ap.add_argument("--hierarchy", default="tiny")
    ap.add_argument("--method", default="pipespec")
    a = ap.parse_args()
    summary = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in a.rows:
            rows, run_dir = Path(tmp) / f"rows-{n}.jsonl", Path(tmp) / f"run-{n}"
            write_rows(rows, n)
            wall = run_job(rows, run_dir, a)
            answered = len((run_dir / "results.openai.jsonl").read_text().splitlines())
            rss = peaks(run_dir)
            print(f"{n:>8} rows ({rows.stat().st_size / 1e6:.1f} MB): peak RSS per rank (MB) "
                  f"{[round(x) for x in rss]}, {wall:.0f} s, {n / wall:.0f} rows/s, {answered} answered",
                  flush=True)  # fmt: skip
            summary.append({"rows": n, "file_mb": rows.stat().st_size / 1e6, "peak_rss_mb": rss,
                            "wall_s": wall, "answered": answered})  # fmt: skip
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
