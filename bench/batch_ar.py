"""Batched AR on the CPUs here: B sequences per forward through the engine (``score_many``).

    .venv/bin/python bench/batch_ar.py [--batch 1,2,4,8] [--prompts 8] [--tokens 64] [--threads 1]

A first piece of issue #14 (many sequences in flight per pipeline): the target decodes the
prompts greedily B at a time, one token per sequence per forward (the engine's ``score_many``:
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
from pipespec_mpi.models.loader import load_stage, load_tokenizer
from pipespec_mpi.run.jobs import tokenize_prompts


@torch.inference_mode()
def decode(pool: list, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], float]:
    """Greedy ``tokens`` new tokens for every prompt, all in one batch on the first slots of
    ``pool`` (slots of one engine); (outputs, decode seconds)."""
    slots = pool[: len(prompts)]
    scorer = slots[0]
    seqs = [list(p) for p in prompts]
    for sc, p in zip(slots, prompts, strict=True):
        sc.prefill(p, room=tokens + 1)
    t0 = time.perf_counter()
    for _ in range(tokens):
        logits = scorer.score_many([(sc, s, []) for sc, s in zip(slots, seqs, strict=True)])
        for s, rows in zip(seqs, logits, strict=True):
            s.append(int(rows[-1].argmax()))
    return [s[len(p) :] for s, p in zip(seqs, prompts, strict=True)], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,2,4,8")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--sdpa", action="store_true", help="attention by SDPA over the grid (no exact rows)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfg = compose_config([f"dataset={a.dataset}", f"dataset.n_prompts={a.prompts}", f"dataset.seed={a.seed}"])
    hier = cfg.hierarchy
    if a.sdpa:
        hier.stages[-1].exact_rows = False
    scorer = load_stage(hier, hier.n_stages - 1, [])
    if not getattr(scorer, "batchable", False):
        raise SystemExit(f"the target does not batch here ({scorer.describe()})")
    pool = [scorer] + [scorer.for_slot() for _ in range(max(int(b) for b in a.batch.split(",")) - 1)]
    prompts = [p.ids for p in tokenize_prompts(cfg, load_tokenizer(hier.tokenizer, hier.name)).prompts]
    sizes = [int(b) for b in a.batch.split(",")]
    secs: dict[int, list[float]] = {b: [] for b in sizes}
    outs: dict[int, list[list[int]]] = {}
    for _ in range(a.rounds):
        for b in sizes:
            total, got = 0.0, []
            for i in range(0, len(prompts), b):
                o, s = decode(pool, prompts[i : i + b], a.tokens)
                got += o
                total += s
            secs[b].append(total)
            outs[b] = got
    cpu = cpu_identity()
    print(f"{cpu['cpu']} ({platform.machine()}; {', '.join(cpu['isa'])}), {a.threads} thread(s), "
          f"torch {torch.__version__}; {len(prompts)} {a.dataset} prompts (seed {a.seed}), "
          f"{a.tokens} tokens each, median of {a.rounds} interleaved rounds, prefill not timed; "
          f"{scorer.describe()}")  # fmt: skip
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
