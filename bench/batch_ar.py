"""Batched AR on the CPUs here: B sequences per forward through the lean forward's batch path.

    .venv/bin/python bench/batch_ar.py [--batch 1,2,4,8] [--prompts 8] [--tokens 64] [--threads 1]

A first piece of issue #14 (many sequences in flight per pipeline): the target decodes the
prompts greedily B at a time, one token per sequence per forward (``LeanLlama.forward_batch``:
linear layers once over the B rows, attention over each sequence's own cache: the row kernel's
one call per layer where the target runs it, as in the job, ``exact_rows``), and the script
reports tokens/s per B, the cost of one batched step against a one-sequence step, and whether
every sequence's tokens equal its B = 1 decode (they must: rows are independent in the flat
kernel). Prefill is per sequence and not timed. Batch sizes interleave round by round.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from pipespec_mpi.auto.fingerprint import cpu_identity
from pipespec_mpi.config import compose_config
from pipespec_mpi.models.kv_cache import preallocated_cache
from pipespec_mpi.models.loader import load_stage, load_tokenizer
from pipespec_mpi.run.jobs import tokenize_prompts


@torch.inference_mode()
def decode(scorer, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], float]:
    """Greedy ``tokens`` new tokens for every prompt, all in one batch; (outputs, decode seconds)."""
    lean, cfg = scorer._lean, scorer.model.config
    caches = [preallocated_cache(cfg, len(p) + tokens + 1) for p in prompts]
    nxt = []
    for p, c in zip(prompts, caches, strict=True):
        nxt.append(int(lean.forward(torch.tensor([p]), c, 1)[0, -1].argmax()))
    out = [[t] for t in nxt]
    t0 = time.perf_counter()
    for _ in range(tokens - 1):
        logits = lean.forward_batch([[t] for t in nxt], caches, rows_alone=scorer.exact_rows)  # [B, V]
        nxt = logits.argmax(-1).tolist()
        for o, t in zip(out, nxt, strict=True):
            o.append(t)
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,2,4,8")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--sdpa", action="store_true", help="attention by SDPA per sequence (no row kernel)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfg = compose_config([f"dataset={a.dataset}", f"dataset.n_prompts={a.prompts}", f"dataset.seed={a.seed}"])
    hier = cfg.hierarchy
    scorer = load_stage(hier, hier.n_stages - 1, [])
    if scorer._lean is None:
        raise SystemExit("the target has no lean forward here; batched AR needs it")
    if a.sdpa:
        scorer.exact_rows = False
    prompts = [p.ids for p in tokenize_prompts(cfg, load_tokenizer(hier.tokenizer, hier.name)).prompts]
    sizes = [int(b) for b in a.batch.split(",")]
    secs: dict[int, list[float]] = {b: [] for b in sizes}
    outs: dict[int, list[list[int]]] = {}
    for _ in range(a.rounds):
        for b in sizes:
            total, got = 0.0, []
            for i in range(0, len(prompts), b):
                o, s = decode(scorer, prompts[i : i + b], a.tokens)
                got += o
                total += s
            secs[b].append(total)
            outs[b] = got
    cpu = cpu_identity()
    print(f"{cpu['cpu']} ({platform.machine()}; {', '.join(cpu['isa'])}), {a.threads} thread(s), "
          f"torch {torch.__version__}; {len(prompts)} {a.dataset} prompts (seed {a.seed}), "
          f"{a.tokens} tokens each, median of {a.rounds} interleaved rounds, prefill not timed; "
          f"attention {'row kernel' if scorer.exact_rows else 'SDPA per sequence'}")  # fmt: skip
    n_tok = len(prompts) * (a.tokens - 1)
    base = statistics.median(secs[sizes[0]])
    print("| B | tokens/s | x B=1 | ms per batched step | step / one-sequence step | outputs = B=1 |")
    print("|---|---|---|---|---|---|")
    for b in sizes:
        s = statistics.median(secs[b])
        steps = -(-len(prompts) // b) * (a.tokens - 1)
        one = base / (-(-len(prompts) // sizes[0]) * (a.tokens - 1))
        print(f"| {b} | {n_tok / s:.1f} | {base / s:.2f} | {1e3 * s / steps:.1f} | "
              f"{s / steps / one:.2f} | {outs[b] == outs[sizes[0]]} |")  # fmt: skip


if __name__ == "__main__":
    main()
