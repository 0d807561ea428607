"""Verification cost curve: the target's forward over k tokens relative to its one-token step.

    .venv/bin/python bench/verify_cost.py [--threads 1] [--context 200] [--rounds 9]

Four variants of SmolLM2-135M float32: stock transformers (torch matmul, ``DynamicCache``,
sdpa); the flat small-M kernel of models/cpu/flat_linear.py with the preallocated cache of
models/kv_cache.py and grouped-query SDPA without KV copies (models/cpu/attention.py); that and the
exact GGUF blocks read through the low-bit kernel (``lowbit.read_exact_blocks``, the loader's
default ``exact_blocks``), both through transformers' forward; and what the target stage runs,
the engine on those kernels with every decoding row's attention alone (``exact_rows``: the row
attention kernel where it builds; models/cpu/plugins.py). k is the rows of the
forward: a verification of k - 1 proposals, or a batched forward of k one-token slots.
Measurements are interleaved: each round times every (variant, k) once in a shuffled order
after the same context, so drifts of a shared machine hit all alike; the table shows medians
over rounds and each variant's ratio to its own one-token step.
Speculative decoding assumes that ratio is close to 1.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from pipespec_mpi.models.cpu.flat_linear import cpu_isa, use_flat_linear
from pipespec_mpi.models.cpu.lowbit import read_exact_blocks
from pipespec_mpi.models.cpu.plugins import cpu_weights
from pipespec_mpi.models.fallback import cache_kwarg, use_sdpa_gqa
from pipespec_mpi.models.kv_cache import preallocated_cache
from pipespec_mpi.models.scorer import Engine, Request
from pipespec_mpi.models.smollm2 import ensure_cache

Forward = Callable[[torch.Tensor, object, int, bool], object]  # (ids, cache, keep, decoding)


def transformers_forward(model) -> Forward:
    name = cache_kwarg(model)  # the KV cache's keyword in the installed transformers
    return lambda ids, cache, keep, decoding: model(input_ids=ids, logits_to_keep=keep, **{name: cache})


def stage(model, capacity: int) -> tuple[Forward, Callable[[], int]]:
    """The engine as the last stage runs it (exact rows), and a fresh slot of it as the cache."""
    engine = Engine(cpu_weights(model, exact_rows=True))

    def new_slot() -> int:
        slot = engine.new_slot()
        engine.begin(slot, capacity)
        return slot

    def fn(ids, slot, keep, decoding):
        tokens = ids[0].tolist()
        if not decoding:
            return engine.prefill(slot, tokens)
        return engine.run([Request(slot, tokens, keep)])

    return fn, new_slot


@torch.inference_mode()
def forward_ms(fn: Forward, new_cache, context: torch.Tensor, k: int) -> float:
    """One k-token forward after ``context`` (its prefill not timed)."""
    cache = new_cache()
    fn(context, cache, 1, False)
    ids = torch.arange(100, 100 + k).view(1, k)  # [1, k]
    t0 = time.perf_counter()
    fn(ids, cache, k, True)
    return 1000 * (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--max-k", type=int, default=9)
    ap.add_argument("--isa", choices=["avx512", "avx2"], help="kernel build (default: the CPU's widest)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = AutoModelForCausalLM.from_pretrained(ensure_cache(), dtype=torch.float32).eval()
    flat, blocks = copy.deepcopy(base), copy.deepcopy(base)
    for model in (flat, blocks):
        replaced = use_flat_linear(model, args.isa)
        use_sdpa_gqa(model)
    read = read_exact_blocks(blocks, args.isa)
    capacity = args.context + args.max_k + 1
    variants = {
        "torch": (transformers_forward(base), lambda: DynamicCache(config=base.config)),
        "flat": (transformers_forward(flat), lambda: preallocated_cache(flat.config, capacity)),
        "blocks": (transformers_forward(blocks), lambda: preallocated_cache(blocks.config, capacity)),
        "stage": stage(blocks, capacity),
    }
    context = torch.randint(0, 49000, (1, args.context), generator=torch.Generator().manual_seed(0))
    ks = list(range(1, args.max_k + 1))
    times: dict[tuple[str, int], list[float]] = {(v, k): [] for v in variants for k in ks}
    for _ in range(args.rounds):
        order = list(times)
        random.shuffle(order)
        for v, k in order:
            times[(v, k)].append(forward_ms(*variants[v], context, k))
    med = {key: statistics.median(ts) for key, ts in times.items()}
    isa = args.isa or cpu_isa()
    print(f"SmolLM2-135M float32, {args.threads} thread(s), context {args.context}, ISA {isa}, "
          f"flat kernel on {replaced} linear layers ({read} reading their blocks), "
          f"median of {args.rounds} interleaved rounds")  # fmt: skip
    print(f"{'k':>3}" + "".join(f" {v + ' ms':>10} {'ratio':>6}" for v in variants))
    for k in ks:
        cols = "".join(f" {med[(v, k)]:>10.1f} {med[(v, k)] / med[(v, 1)]:>6.2f}" for v in variants)
        print(f"{k:>3}{cols}")


if __name__ == "__main__":
    main()
