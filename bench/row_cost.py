"""What a batched forward of the target costs per slot and per verification row.

    .venv/bin/python bench/row_cost.py [--threads 2] [--rounds 5] [--context 200]

The adaptive batched stage gives a verification row only where it pays (stage/batch.py,
``goodput.RowCost``): it fits a forward's seconds as fixed + per_slot B + per_row e for B slots
and e verification rows beyond their own. This times the target's batched forwards
(``stage/batch.py score_batch``, as the job runs them) over a grid of (B, e), interleaved round
by round, at a fixed context per slot, and prints the medians, the three-term fit of all of
them, and the one line in all rows that a fit of steps alone (e = 0) would give.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

import torch

from pipespec_mpi.auto.fingerprint import cpu_identity
from pipespec_mpi.config import compose_config
from pipespec_mpi.models.loader import load_stage
from pipespec_mpi.speculative.goodput import RowCost, RowLine, allot_rows, survivals
from pipespec_mpi.stage.batch import score_batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--slots", default="1,2,3,4")
    ap.add_argument("--extra", default="0,2,4,8,12")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    hier = compose_config([]).hierarchy
    target = load_stage(hier, hier.n_stages - 1, [])
    rng = random.Random(0)
    vocab = target.vocab_size
    slots = [target.for_slot() for _ in range(max(int(b) for b in a.slots.split(",")))]
    seqs = []
    for sc in slots:
        seq = [rng.randrange(vocab) for _ in range(a.context)]
        sc.prefill(seq, room=64)  # the cache holds the context but its last token
        seqs.append(seq)
    grid = [(int(b), int(e)) for b in a.slots.split(",") for e in a.extra.split(",") if int(b) + int(e) <= 16]
    secs: dict[tuple[int, int], list[float]] = {g: [] for g in grid}
    for _ in range(a.rounds):
        for b, e in grid:
            share = [e // b + (i < e % b) for i in range(b)]  # the extra rows spread over the slots
            reqs = [(slots[i], seqs[i], [rng.randrange(vocab) for _ in range(share[i])]) for i in range(b)]
            t0 = time.perf_counter()
            score_batch(reqs)
            secs[(b, e)].append(time.perf_counter() - t0)
            for i in range(b):
                slots[i].truncate(a.context - 1)
    cpu = cpu_identity()
    print(f"{cpu['cpu']} ({platform.machine()}; {', '.join(cpu['isa'])}), {a.threads} thread(s), "
          f"torch {torch.__version__}; target {hier.stages[-1].name}, context {a.context} per slot, "
          f"median of {a.rounds} interleaved rounds")  # fmt: skip
    print("| slots B | extra rows e | ms |")
    print("|---|---|---|")
    both = RowCost(rate=0.0)
    for b, e in grid:
        ms = 1e3 * statistics.median(secs[(b, e)])
        print(f"| {b} | {e} | {ms:.1f} |")
        both.observe(b, b + e, ms / 1e3)
    fit = both.line()
    # what each fit gives out: four slots, four proposals each, every position accepted at 0.8
    asked = [survivals([0.8] * 4, 4)] * 4
    print(f"fit of every forward: fixed {1e3 * fit.fixed:.2f} ms, per slot {1e3 * fit.per_slot:.2f} ms, "
          f"per verification row {1e3 * fit.per_row:.2f} ms; four slots asking four rows at "
          f"acceptance 0.8 get {allot_rows(asked, 16, fit)}")  # fmt: skip
    # steps alone (e = 0) fitted as one line in all rows: a verification row priced as a slot
    steps = [(b, statistics.median(secs[(b, e)])) for b, e in grid if e == 0]
    if len(steps) >= 2:
        beta, alpha = statistics.linear_regression([b for b, _ in steps], [s for _, s in steps])
        line = RowLine(max(0.0, alpha), beta, beta)
        print(f"one line in rows from steps alone: {1e3 * alpha:.2f} ms + {1e3 * beta:.2f} ms a row; "
              f"the same four slots would get {allot_rows(asked, 16, line)}")  # fmt: skip


if __name__ == "__main__":
    main()
