"""The default pipeline with its target on another host of the multi-host bed, against the same
pipeline on one host: what crossing an interconnect costs the loop.

    .venv/bin/python bench/cross_node.py [--delays 0.1,1] [--prompts 4] [--tokens 64] [OVERRIDES]

Runs (root; tests/multihost/netbed.py): one host (shared-memory epochs); then for each one-way delay
two bed hosts, stages 0-1 on one and the target on the other, with the pushed epochs window (the
default across nodes) and the RMA window. Each run is ``run.mode=benchmark`` (AR and PipeSpec
interleaved) on held-out HumanEval prompts (dataset.seed=7). Printed per run: ms/token of both,
the speedup, and per model stage the time its loop spent reading its neighbours' headers per
forward and as a share of its forwards' time (an upper bound of the overhead: it includes the
reads a stage makes while it waits with nothing to do).

The bed's hosts share this machine's cores, so every stage runs one torch thread in every run
(what the three ranks of the one-host run get on 2 cores; alone on its host the target would take
both cores and oversubscribe them).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "multihost"))  # the bed: tests/multihost/netbed.py

import netbed  # noqa: E402

from pipespec_mpi.records import read_records  # noqa: E402


def app_args(run_dir: Path, window: str, args: argparse.Namespace) -> list[str]:
    return [
        sys.executable, "-m", "pipespec_mpi", "run.mode=benchmark", "run.methods=[ar,pipespec]",
        "dataset.seed=7", f"dataset.n_prompts={args.prompts}", f"decode.max_new_tokens={args.tokens}",
        f"run.epochs_window={window}", "run.progress=false", f"hydra.run.dir={run_dir}",
        *(f"hierarchy.stages.{s}.threads=1" for s in (1, 2)), *args.overrides,
    ]  # fmt: skip


def summarise(label: str, run_dir: Path) -> str:
    recs = [r for r in read_records(run_dir / "results.jsonl") if not r.warmup]
    ms = {}
    for m in ("ar", "pipespec"):
        rs = [r for r in recs if r.method == m]
        ms[m] = 1000 * sum(r.wall_s for r in rs) / sum(r.n_new_tokens for r in rs)
    ps = [r for r in recs if r.method == "pipespec"]
    shares = []
    for s in range(len(ps[0].stages)):
        read = sum(r.stages[s].read_s for r in ps)
        fwd = sum(r.stages[s].forward_calls for r in ps)
        busy = sum(r.stages[s].busy_s for r in ps)
        if not fwd:  # a prompt lookup makes no forward
            shares.append("-")
            continue
        shares.append(f"{1000 * read / fwd:.3f} ms ({100 * read / busy:.2f}%)")
    window, hosts = ps[0].epochs_window, "/".join(ps[0].hosts)
    return (
        f"| {label} | {window} | {hosts} | {ms['ar']:.2f} | {ms['pipespec']:.2f} | "
        f"{ms['ar'] / ms['pipespec']:.2f} | " + " | ".join(shares) + " |"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--delays", default="0.1,1")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--windows", default="push,rma")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    why = netbed.problem()
    if why:
        sys.exit(f"cross_node: {why}")
    out = Path(tempfile.mkdtemp(prefix="cross_node-"))
    rows = []
    mpirun = Path(sys.executable).parent / "mpirun"
    d = out / "one-host"
    subprocess.run([str(mpirun), "-n", "3", *app_args(d, "auto", args)], cwd=ROOT, check=True)
    rows.append(summarise("one host", d))
    print(rows[-1], flush=True)
    for delay in (float(x) for x in args.delays.split(",")):
        with netbed.NetBed(netbed.BedConfig(name="psxnode", hosts=2, delay_ms=delay, net=82)) as bed:
            for window in args.windows.split(","):
                d = out / f"bed-{delay}-{window}"
                subprocess.run(bed.mpirun(3, 2, app_args(d, window, args)), cwd=ROOT, check=True)
                rows.append(summarise(f"2 hosts, {delay} ms one way", d))
                print(rows[-1], flush=True)
    print("\n| where | epochs | hosts per stage | AR ms/token | PipeSpec ms/token | speedup | "
          "reads per forward, stage 0 | stage 1 | stage 2 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\nrun directories under {out}")


if __name__ == "__main__":
    main()
