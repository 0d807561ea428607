"""The engine's compiled forward (``device.compile``) against its eager one, paired call by call.

    .venv/bin/python bench/compiled_step.py [--shape 135M] [--pairs 30] [--device cpu]

One engine of ``shape`` with random weights (models/shapes.py), its forward as a job compiles it
(models/scorer.py ``compile_forward``) and eager, alternating in alternating order over the same
cache, so the machine's drift hits every pair alike: a one-token step, verifications of 4 and 8
rows and 4 and 8 slots of one token, at 256 positions. Prints the first calls' compile seconds,
then per shape the median of the paired ratios (compiled / eager) and its quartiles.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pipespec_mpi.models import engine as eng
from pipespec_mpi.models.scorer import Request, compile_forward
from pipespec_mpi.simulate.profile import random_engine

CONTEXT = 256
CASES = {"step": (1, 1), "verify 4": (4, 1), "verify 8": (8, 1), "4 slots": (1, 4), "8 slots": (1, 8)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="135M")
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    torch.manual_seed(0)
    dtype = "bfloat16" if a.device.startswith("cuda") else "float32"
    e = random_engine(a.shape, a.device, dtype, 8, CONTEXT + 40)
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    modes = {"compiled": compile_forward(e.w), "eager": eng.forward}

    def run(mode: str, rows: int, slots: int) -> float:
        e.step, e.compiled = modes[mode], mode == "compiled"
        for s in range(slots):
            e.lengths[s] = CONTEXT
        t = time.perf_counter()
        e.run([Request(s, [1] * rows, rows) for s in range(slots)])
        sync()
        return time.perf_counter() - t

    t = time.perf_counter()
    for rows, slots in CASES.values():
        run("compiled", rows, slots)
    print(f"{a.shape} on {a.device}, {dtype}: first calls (compiling) {time.perf_counter() - t:.1f} s")
    for name, (rows, slots) in CASES.items():
        ratios = []
        for i in range(a.pairs):
            order = ("compiled", "eager") if i % 2 else ("eager", "compiled")
            got = {m: run(m, rows, slots) for m in order}
            ratios.append(got["compiled"] / got["eager"])
        q = statistics.quantiles(ratios, n=4)
        med = statistics.median(ratios)
        print(f"{name:>9}: compiled / eager {med:.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})")


if __name__ == "__main__":
    main()
