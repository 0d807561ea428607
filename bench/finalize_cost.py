"""What rank 0's finalize costs per record: time and peak RSS against the number of records.

    .venv/bin/python bench/finalize_cost.py RUN_DIR [--records 10000 100000] [--format openai]

RUN_DIR is any finished run (its ``parts/`` and ``.hydra/config.yaml``); its records are copied,
cycled, into a fresh run directory of N records per size (new prompt ids, rows and job numbers,
in reversed row order so that the sort has work), and ``run/finalize.py``'s ``finalize`` runs on
it in a child process (its peak RSS read with getrusage). Prints one line per size and a JSON
summary. The other ranks of a job wait for this (``FINALIZE_WAIT_S`` in run/runner.py), so its
time per record bounds how many rows one job can hold.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import resource, sys, time
from pathlib import Path
from pipespec_mpi.config import load_run_config
from pipespec_mpi.run.finalize import finalize
run = Path(sys.argv[1])
cfg = load_run_config(run)
t0 = time.perf_counter()
finalize(cfg, run)
print("FINALIZE", time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def build(template: Path, out: Path, n: int, fmt: str | None) -> None:
    lines = [
        ln for p in sorted((template / "parts").glob("replica-*.jsonl")) for ln in p.open() if ln.strip()
    ]
    if not lines:
        raise SystemExit(f"{template}/parts: no records")
    (out / "parts").mkdir(parents=True)
    shutil.copytree(template / ".hydra", out / ".hydra")
    if fmt:
        cfg = out / ".hydra" / "config.yaml"
        text = cfg.read_text()
        cfg.write_text(
            text.replace(text[text.index("output_format:") :].split("\n", 1)[0], f"output_format: {fmt}")
        )
    with open(out / "parts" / "replica-0.jsonl", "w", encoding="utf-8") as f:
        for i in range(n):
            rec = json.loads(lines[i % len(lines)])
            row = n - 1 - i  # reversed: the sort has to move every record
            rec.update(prompt_id=f"row-{row}", position=row, seq=i + 1, warmup=False)
            f.write(json.dumps(rec) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--records", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--format", default=None, help="run.output_format for the copies (default: the run's)")
    a = ap.parse_args()
    out = []
    for n in a.records:
        work = Path(tempfile.mkdtemp(prefix="finalize_cost_"))
        try:
            build(a.run_dir, work / "run", n, a.format)
            size = (work / "run" / "parts" / "replica-0.jsonl").stat().st_size / 1e6
            t0 = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-c", CHILD, str(work / "run")], capture_output=True, text=True
            )
            wall = time.perf_counter() - t0
            if proc.returncode != 0:
                raise SystemExit(proc.stderr[-3000:])
            line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("FINALIZE"))
            secs, rss = (float(x) for x in line.split()[1:])
            row = {
                "records": n,
                "parts_mb": round(size, 1),
                "finalize_s": round(secs, 2),
                "ms_per_record": round(1000 * secs / n, 3),
                "peak_rss_mb": round(rss),
                "process_s": round(wall, 1),
            }
            print(
                f"{n:>8} records ({size:.0f} MB of parts): finalize {secs:.1f} s, "
                f"{1000 * secs / n:.2f} ms/record, peak RSS {rss:.0f} MB",
                flush=True,
            )
            out.append(row)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
