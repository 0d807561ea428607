"""Would Token Recycling feed stage 0 better chains than the suffix drafter? A replay, no pipeline.

    .venv/bin/python bench/recycle_replay.py [--prompts 8] [--seed 7] [--tokens 96]

The target decodes each prompt greedily; then each drafter is replayed over that output as a
verifier would see it: at each step it proposes up to 8 tokens, the tokens that match the
target's output are accepted, and the step commits them plus the correction. Drafters:

  suffix                   models/suffix.py as stage 0 runs it (job store across the prompts)
  recycle(committed)       Token Recycling's table (each token -> the top-k of the distribution
                           after it, newest wins), filled from the target's logits at the
                           positions it commits: what a verifier could send upstream; a chain
                           follows the top-1 entries
  recycle(+prompt)         the same, the table also filled at every prompt position (the
                           verifier's prefill would have to compute the LM head over the prompt)
  suffix+recycle(+prompt)  the suffix draft, else the recycled chain

The table gets the target's own logits for free here, so this is an upper bound for a recycled
chain. Reported per drafter: coverage (steps with a proposal), accepted tokens per proposal,
tokens committed per verifier step.
"""

from __future__ import annotations

import argparse

import torch
from drafters import greedy

from pipespec_mpi.config import compose_config
from pipespec_mpi.models.loader import load_stage, load_tokenizer
from pipespec_mpi.models.suffix import SuffixDrafter
from pipespec_mpi.run.jobs import tokenize_prompts

K = 8
MAXP = 8


class Recycle:
    def __init__(self, prompt_rows: bool):
        self.table: dict[int, list[int]] = {}
        self.prompt_rows = prompt_rows

    def propose(self, seq, limit):
        out = []
        t = seq[-1]
        while len(out) < limit and t in self.table:
            t = self.table[t][0]
            out.append(t)
        return out

    def update(self, seq, topk, lo, hi):
        # topk[p]: top-k of the distribution after position p
        for p in range(lo, hi):
            self.table[seq[p]] = topk[p]


def replay(name, drafter, prompt, out, topk, stats):
    seq = list(prompt)
    i = 0
    n = len(out)
    if isinstance(drafter, Recycle) and drafter.prompt_rows:
        drafter.update(prompt + out, topk, 0, len(prompt) - 1)
    while i < n:
        limit = min(MAXP, n - i - 1)
        if isinstance(drafter, SuffixDrafter):
            d = drafter.propose(seq, limit, confirmed=len(seq)) if limit > 0 else []
        elif isinstance(drafter, tuple):  # combination: suffix, else recycle
            s, r = drafter
            d = s.propose(seq, limit, confirmed=len(seq)) if limit > 0 else []
            if not d and limit > 0:
                d = r.propose(seq, limit)
        else:
            d = drafter.propose(seq, limit) if limit > 0 else []
        acc = 0
        while acc < len(d) and d[acc] == out[i + acc]:
            acc += 1
        stats["steps"] += 1
        if d:
            stats["verif"] += 1
            stats["acc"] += acc
            stats["prop"] += len(d)
        new = out[i : i + acc + 1]
        full = prompt + out
        rec = (
            drafter if isinstance(drafter, Recycle) else (drafter[1] if isinstance(drafter, tuple) else None)
        )
        if rec is not None:
            rec.update(full, topk, len(seq) - 1, len(seq) - 1 + len(new))
        seq += new
        i += len(new)
    s = (
        drafter
        if isinstance(drafter, SuffixDrafter)
        else (drafter[0] if isinstance(drafter, tuple) else None)
    )
    if s is not None:
        s.end_sequence(out)


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=96)
    a = ap.parse_args()
    torch.set_num_threads(2)
    cfg0 = compose_config(["hierarchy=smollm2"])
    hier = cfg0.hierarchy
    target = load_stage(hier, 2, [])
    tok = load_tokenizer(hier.tokenizer, hier.name)
    for ds in ("humaneval", "news"):
        cfg = compose_config([f"dataset={ds}", f"dataset.n_prompts={a.prompts}", f"dataset.seed={a.seed}"])
        data = []
        for ids in (p.ids for p in tokenize_prompts(cfg, tok).prompts):
            out = greedy(target, ids, a.tokens)
            full = ids + out
            logits = target.model(torch.tensor([full])).logits[0]
            topk = logits.topk(K, -1).indices.tolist()
            assert topk[len(ids) - 1][0] == out[0]
            data.append((ids, out, topk))
        drafters = {
            "suffix": lambda: SuffixDrafter("s"),
            "recycle(committed)": lambda: Recycle(False),
            "recycle(+prompt)": lambda: Recycle(True),
            "suffix+recycle(+prompt)": lambda: (SuffixDrafter("s"), Recycle(True)),
        }
        for name, make in drafters.items():
            d = make()
            st = dict(steps=0, verif=0, acc=0, prop=0)
            for ids, out, topk in data:
                replay(name, d, ids, out, topk, st)
            print(
                f"{ds:10s} {name:26s} steps {st['steps']:4d} coverage {st['verif'] / st['steps']:.2f} "
                f"acc/verif {st['acc'] / max(1, st['verif']):.2f} "
                f"prop/verif {st['prop'] / max(1, st['verif']):.2f} "
                f"tokens/step {a.tokens * len(data) / st['steps']:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
