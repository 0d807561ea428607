"""The low-bit kernel alone over SmolLM2-135M's linear shapes: ms per forward's linears by rows.

    .venv/bin/python bench/lowbit_linears.py [--formats q4 int8] [--rows 1 2 4 8 12 16]
                                             [--rounds 5] [--threads 1]

Thirty layers of random weights in each format with the model's shapes (fused q|k|v 576 -> 960,
fused gate|up 576 -> 3072, down 1536 -> 576, o 576 -> 576), distinct per layer, so the weights
stream from memory as a forward's do; x is [rows, K]. Each round times every (format, rows) once
in a shuffled order (a drifting machine hits all alike); prints medians. The embedded target's
layers are q4 (its GGUF's Q4_1 blocks), the default middle stage's int8. The output layer and
everything that is not a linear layer (attention, norms) are not in these numbers: the
whole forward is ``bench/dense_rows.py``'s and ``bench/verify_cost.py``'s.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from pipespec_mpi.models.cpu import lowbit
from pipespec_mpi.models.cpu.flat_linear import cpu_isa

SHAPES = [(576, 960), (576, 3072), (1536, 576), (576, 576)]  # (K, N) per layer
LAYERS = 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="+", default=["q4", "int8"], choices=lowbit.FORMATS)
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 12, 16])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ext = lowbit.extension()
    if ext is None:
        raise SystemExit("the low-bit kernel cannot be built on this CPU")
    gen = torch.Generator().manual_seed(0)

    def layer(fmt: str) -> list[tuple[torch.Tensor, ...]]:
        return [lowbit.quantize(torch.randn(n, k, generator=gen) * 0.02, fmt) for k, n in SHAPES]

    weights = {fmt: [layer(fmt) for _ in range(LAYERS)] for fmt in args.formats}
    xs = {r: {k: torch.randn(r, k, generator=gen) for k, _ in SHAPES} for r in args.rows}
    times: dict[tuple[str, int], list[float]] = {(f, r): [] for f in args.formats for r in args.rows}
    for _ in range(args.rounds):
        order = list(times)
        random.shuffle(order)
        for fmt, r in order:
            fn = getattr(ext, f"{fmt}_linear")
            t0 = time.perf_counter()
            for layer in weights[fmt]:
                for (k, _), tensors in zip(SHAPES, layer, strict=True):
                    fn(xs[r][k], *tensors)
            times[(fmt, r)].append((time.perf_counter() - t0) * 1e3)
    print(f"kernel build {cpu_isa()}, {args.threads} thread(s), medians of {args.rounds} rounds, ms")
    print("format " + " ".join(f"{r:>7}" for r in args.rows))
    for fmt in args.formats:
        print(f"{fmt:<6} " + " ".join(f"{statistics.median(times[(fmt, r)]):7.1f}" for r in args.rows))


if __name__ == "__main__":
    main()
