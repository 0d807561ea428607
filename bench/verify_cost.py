"""Verification cost curve: the target's forward over k tokens relative to its one-token step.

    .venv/bin/python bench/verify_cost.py [--threads 1] [--context 200] [--reps 9]

Prints, for k = 1..9, the median time of a k-token forward (after a context of --context tokens)
with torch's own matmul and with the flat small-M kernel (models/flat_linear.py), and the ratio
to the one-token step. Speculative decoding assumes this ratio is close to 1.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from pipespec_mpi.models.flat_linear import use_flat_linear
from pipespec_mpi.models.smollm2 import ensure_cache


def forward_ms(model, context: torch.Tensor, k: int, reps: int) -> float:
    times = []
    for _ in range(reps):
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=context, cache=cache, logits_to_keep=1)
            t0 = time.perf_counter()
            model(input_ids=torch.arange(100, 100 + k).view(1, k), cache=cache, logits_to_keep=k)
            times.append(time.perf_counter() - t0)
    times.sort()
    return 1000 * times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = AutoModelForCausalLM.from_pretrained(ensure_cache(), dtype=torch.float32).eval()
    flat = copy.deepcopy(base)
    replaced = use_flat_linear(flat)
    context = torch.randint(0, 49000, (1, args.context))
    print(f"SmolLM2-135M float32, {args.threads} thread(s), context {args.context}, "
          f"flat kernel on {replaced} linear layers")  # fmt: skip
    print(f"{'k':>3} {'torch ms':>9} {'ratio':>6} {'flat ms':>8} {'ratio':>6}")
    one = forward_ms(base, context, 1, args.reps)
    for k in range(1, 10):
        t = forward_ms(base, context, k, args.reps)
        f = forward_ms(flat, context, k, args.reps)
        print(f"{k:>3} {t:>9.1f} {t / one:>6.2f} {f:>8.1f} {f / one:>6.2f}")


if __name__ == "__main__":
    main()
