"""The exact law of the tiny target's first two sampled tokens, and a chi-square test against it
(shared by the MPI sampling tests and the in-process ones)."""

from __future__ import annotations

import math
from collections import Counter

import torch

from pipespec_mpi.config import TinyBaseConfig
from pipespec_mpi.models.tiny import build_tiny
from pipespec_mpi.speculative.sampling import processed_logprobs

N = 400  # samples per test
PROMPT = "def fib(n):"
PROMPT_IDS = [256, *PROMPT.encode()]  # the byte tokenizer's BOS, then the bytes
EOS = 257


def exact_joint(temperature: float, top_k: int, top_p: float) -> dict[tuple, float]:
    """P(first two tokens) under the target alone; a sequence ending in EOS is a 1-tuple."""
    target = build_tiny(TinyBaseConfig(), None, 0.0, 2, torch.float64)
    ids = PROMPT_IDS

    def probs(seq):
        with torch.no_grad():
            logits = target(input_ids=torch.tensor([seq])).logits[0, -1:]
        return processed_logprobs(logits, temperature, top_k, top_p)[0].exp()

    p1 = probs(ids)
    joint = {}
    for a in torch.nonzero(p1 > 0).flatten().tolist():
        if a == EOS:
            joint[(a,)] = float(p1[a])
            continue
        p2 = probs([*ids, a])
        for b in torch.nonzero(p2 > 0).flatten().tolist():
            joint[(a, b)] = float(p1[a] * p2[b])
    return joint


def chi_square(samples: list[tuple[int, int]], joint: dict) -> tuple[float, float]:
    """Statistic and a critical value at about p = 1e-4 (bins with expected count < 5 pooled)."""
    counts = Counter(samples)
    outside = sum(c for k, c in counts.items() if k not in joint)
    if outside:
        return float("inf"), 0.0
    bins, pooled_e, pooled_o = [], 0.0, 0
    for k, p in joint.items():
        e = p * len(samples)
        if e >= 5:
            bins.append((counts.get(k, 0), e))
        else:
            pooled_e += e
            pooled_o += counts.get(k, 0)
    if pooled_e > 0:
        bins.append((pooled_o, pooled_e))
    stat = sum((o - e) ** 2 / e for o, e in bins)
    df = max(1, len(bins) - 1)
    # Wilson-Hilferty approximation of the chi-square quantile, z = 3.72 (p ~ 1e-4)
    crit = df * (1 - 2 / (9 * df) + 3.72 * math.sqrt(2 / (9 * df))) ** 3
    return stat, crit
