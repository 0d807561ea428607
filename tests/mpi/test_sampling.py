"""Sampled output must follow the last model's own distribution exactly, through 2 and 3
asynchronous stages. The exact joint distribution of the first two tokens is computed from the
tiny target itself; samples from a real mpirun are compared to it with a chi-square test. The
same test must reject a deliberately broken verifier that accepts every proposal."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import launch_ok, outputs_by_method

from pipespec_mpi.config import TinyBaseConfig
from pipespec_mpi.models.tiny import build_tiny
from pipespec_mpi.speculative.sampling import processed_logprobs

pytestmark = [pytest.mark.mpi, pytest.mark.slow]
N = 400
PROMPT = "def fib(n):"
EOS = 257


def exact_joint(temperature: float, top_k: int, top_p: float) -> dict[tuple, float]:
    """P(first two tokens) under the target alone; a sequence ending in EOS is a 1-tuple."""
    target = build_tiny(TinyBaseConfig(), None, 0.0, 2, torch.float64)
    ids = [256, *PROMPT.encode()]

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


def sample_pairs(
    tmp: Path, hier: str, n: int, temperature: float, top_k: int, top_p: float, coupling: str, env=None
) -> list:
    jsonl = tmp / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": PROMPT, "id": "fib"}) + "\n")
    recs = launch_ok(
        n,
        [f"hierarchy={hier}", "dataset=jsonl", f"dataset.path={jsonl}", "method=pipespec",
         "max_new_tokens=6", "lookahead=2", f"sampling.temperature={temperature}", f"sampling.top_p={top_p}",
         f"sampling.top_k={top_k}", f"sampling.coupling={coupling}",
         f"sampling.num_samples={N}", "seed=7"],
        tmp / "run",
        timeout=600,
        env=env,
    )  # fmt: skip
    assert len(recs) == N
    assert sum(r["stages"][-1]["tokens_accepted"] for r in recs) > 0  # verification happened
    return [tuple(r["output_ids"][:2]) for r in recs]


# The tiny models' distributions are nearly flat over 260 ids at temperature 1, so top-k keeps
# the joint support of two tokens small enough (16-25 pairs) for 400 samples to test it.
CASES = [("tiny", 3, 1.0, 4, 1.0), ("tiny2", 2, 0.3, 6, 0.8)]


@pytest.mark.parametrize("coupling", ["leviathan", "gumbel"])
@pytest.mark.parametrize("hier,n,temperature,top_k,top_p", CASES)
def test_pipespec_samples_follow_the_target_distribution(
    tmp_path, hier, n, temperature, top_k, top_p, coupling
):
    joint = exact_joint(temperature, top_k, top_p)
    pairs = sample_pairs(tmp_path, hier, n, temperature, top_k, top_p, coupling)
    stat, crit = chi_square(pairs, joint)
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f}: samples do not follow the target"


@pytest.mark.parametrize("coupling", ["leviathan", "gumbel"])
def test_the_same_test_catches_an_always_accepting_verifier(tmp_path, coupling):
    joint = exact_joint(1.0, 4, 1.0)
    env = {"PIPESPEC_BROKEN_VERIFIER": "1"}
    pairs = sample_pairs(tmp_path, "tiny", 3, 1.0, 4, 1.0, coupling, env=env)
    stat, crit = chi_square(pairs, joint)
    assert stat > crit, f"broken verifier not detected: chi2 {stat:.1f} < {crit:.1f}"


def test_gumbel_sampling_is_reproducible_and_identical_across_methods(tmp_path):
    args = ["hierarchy=tiny", "dataset=synthetic", "n_prompts=2", "max_new_tokens=20",
            "mode=benchmark", "lookahead=2", "sampling.temperature=0.8", "sampling.top_k=20",
            "sampling.num_samples=2", "sampling.coupling=gumbel"]  # fmt: skip
    a = outputs_by_method(launch_ok(3, args, tmp_path / "a"))
    b = outputs_by_method(launch_ok(3, args, tmp_path / "b"))
    assert a == b  # same seed, same tokens, whatever the timing
    assert a["pipespec"] == a["ar"] == a["sd"]


def test_leviathan_ar_is_reproducible_and_distributions_travel(tmp_path):
    args = ["hierarchy=tiny", "dataset=synthetic", "n_prompts=2", "max_new_tokens=20",
            "mode=benchmark", "lookahead=2", "sampling.temperature=0.8",
            "sampling.num_samples=2"]  # fmt: skip
    ra, rb = launch_ok(3, args, tmp_path / "a"), launch_ok(3, args, tmp_path / "b")
    assert outputs_by_method(ra)["ar"] == outputs_by_method(rb)["ar"]
    ps = [r for r in ra if r["method"] == "pipespec"]
    sent = sum(r["stages"][0]["bytes_sent"] for r in ps)
    proposed = sum(r["stages"][0]["tokens_proposed"] for r in ps)
    assert proposed > 0 and sent >= proposed * 260 * 4  # a float32 row of V=260 per token
