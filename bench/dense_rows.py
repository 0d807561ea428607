"""A low-bit copy's forward over k rows: the kernel against torch's dense GEMM (``dense_rows``).

    .venv/bin/python bench/dense_rows.py [--formats int8 w8a8] [--rows 8 16 24 32 64 150]
                                         [--threads 1] [--context 200] [--rounds 7]

The SmolLM2-135M copy as the default hierarchy's middle stage loads it (lean forward, fused
layers), once with ``dense_rows=0`` (kernel only) and once with ``dense_rows=3`` (every forward of
3 rows or more through ``models/cpu/lowbit.py dense_linear``; the output layer, over 2 rows, stays on
the kernel). Each round times every (format, path, k) once in a
shuffled order: a k-token forward after the same context (the context's prefill not timed), so a
drifting machine hits all alike. Prints medians and the dense/kernel ratio: the rows where it
falls below 1 are where ``lowbit.DENSE_ROWS`` should lie on this CPU.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from pipespec_mpi.config.load import compose_config
from pipespec_mpi.models.cpu.flat_linear import cpu_flags
from pipespec_mpi.models.loader import load_stage


def forward_ms(scorer, context: list[int], k: int) -> float:
    scorer.prefill(context, room=k + 1)
    seq = context + list(range(100, 100 + k - 1))
    t0 = time.perf_counter()
    scorer.logits(seq, [7])  # the context's last token, k-1 more and one proposal: k rows
    return 1000 * (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", nargs="+", default=["int8", "w8a8"])
    ap.add_argument("--rows", nargs="+", type=int, default=[4, 8, 16, 24, 32, 48, 64, 150])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    scorers = {}
    for fmt in args.formats:
        for path, dense in (("kernel", 0), ("dense", 3)):
            over = [f"hierarchy.stages.1.weights={fmt}", f"hierarchy.stages.1.dense_rows={dense}"]
            scorers[(fmt, path)] = load_stage(compose_config(over).hierarchy, 1, [])
    context = torch.randint(0, 49000, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
    times: dict[tuple[str, str, int], list[float]] = {(*v, k): [] for v in scorers for k in args.rows}
    for _ in range(args.rounds):
        order = list(times)
        random.shuffle(order)
        for fmt, path, k in order:
            times[(fmt, path, k)].append(forward_ms(scorers[(fmt, path)], context, k))
    med = {key: statistics.median(ts) for key, ts in times.items()}
    amx = sorted(f for f in cpu_flags() if f.startswith("amx"))
    print(f"SmolLM2-135M copy, {args.threads} thread(s), context {args.context}, AMX {amx or 'none'}, "
          f"median of {args.rounds} interleaved rounds (ms per forward)")  # fmt: skip
    print(f"{'format':>6} {'rows':>5} {'kernel':>8} {'dense':>8} {'ratio':>6}")
    for fmt in args.formats:
        for k in args.rows:
            a, b = med[(fmt, "kernel", k)], med[(fmt, "dense", k)]
            print(f"{fmt:>6} {k:>5} {a:>8.1f} {b:>8.1f} {b / a:>6.2f}")


if __name__ == "__main__":
    main()
