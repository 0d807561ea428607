"""The target's forward cost by rows, as the stages run it (exact GGUF blocks through the low-bit kernel).

    .venv/bin/python bench/block_rows.py [--rows 1 4 8 12 16] [--context 200] [--rounds 5]

SmolLM2-135M-Instruct as the loader builds a float32 CPU stage (grouped-query SDPA, the flat
kernel, ``read_exact_blocks``), one torch thread. Each round times every row count once, in a
shuffled order, after the same ``--context`` tokens (their prefill not timed), so drifts of a
shared machine hit all alike; the table shows the median per row count. Rows are what a
verification of k proposals (k + 1 rows) or a batched forward of B slots costs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from pipespec_mpi.models.attention import use_sdpa_gqa
from pipespec_mpi.models.flat_linear import use_flat_linear
from pipespec_mpi.models.kv_cache import preallocated_cache
from pipespec_mpi.models.lowbit import read_exact_blocks
from pipespec_mpi.models.smollm2 import ensure_cache


@torch.inference_mode()
def forward_ms(model: torch.nn.Module, context: torch.Tensor, rows: int) -> float:
    """One forward of ``rows`` new tokens after ``context``."""
    cache = preallocated_cache(model.config, context.shape[1] + rows + 8)
    model(input_ids=context, past_key_values=cache, logits_to_keep=1)
    ids = torch.arange(100, 100 + rows).view(1, rows)
    t0 = time.perf_counter()
    model(input_ids=ids, past_key_values=cache, logits_to_keep=rows)
    return 1000 * (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16])
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(ensure_cache()), torch_dtype=torch.float32).eval()
    use_sdpa_gqa(model)
    use_flat_linear(model)
    print(f"layers reading their blocks: {read_exact_blocks(model)}")
    context = torch.arange(1000, 1000 + args.context).view(1, args.context)
    times: dict[int, list[float]] = {r: [] for r in args.rows}
    for _ in range(args.rounds):
        order = list(args.rows)
        random.shuffle(order)
        for rows in order:
            times[rows].append(forward_ms(model, context, rows))
    print("| rows | ms |\n|---|---|")
    for rows in sorted(times):
        print(f"| {rows} | {statistics.median(times[rows]):.1f} |")


if __name__ == "__main__":
    main()
