"""Sampling that stays exact through an asynchronous hierarchy: shared per-position Gumbel noise.

Every stage draws "its" token at generated position t as

    x_t = argmax_v ( log p(v | prefix) + G_t(v) ),   G_t(v) ~ Gumbel(0, 1) i.i.d.,

where p is the stage's distribution after temperature / top-k / top-p, and the noise G_t depends
only on (seed, prompt, sample index, t), so all stages, and all reruns, use the same G_t. By the
Gumbel-max trick x_t is an exact sample from p(. | prefix); with fresh noise per position the
sequence is an exact autoregressive sample. A verifier then accepts a proposed token iff it
equals its own perturbed argmax, which is the greedy rule applied to perturbed logits: the last
stage's output is, token for token, what the last model alone samples with the same seed
(``method=ar``), whatever the drafts were and whatever the timing. Drafts are accepted with the
Gumbel coupling's probability P[argmax(log q + G) = argmax(log p + G)], which is lower than the
optimal min(1, p/q) rule of Leviathan et al. only by how much p and q differ; nothing but token
ids has to travel between stages.

Temperature 0 is greedy decoding (no noise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK = (1 << 63) - 1


@dataclass(frozen=True)
class Sampler:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    key: int = 0  # (seed, prompt, sample index) mixed into one integer by the runner

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def tokens(self, logits: torch.Tensor, first_position: int) -> torch.Tensor:
        """The stage's choice at positions first_position.. for logits [n, V] -> ids [n]."""
        if self.greedy:
            return torch.argmax(logits, dim=-1)
        logp = processed_logprobs(logits, self.temperature, self.top_k, self.top_p)
        noise = torch.stack(
            [gumbel(self.key, first_position + i, logits.shape[-1]) for i in range(logits.shape[0])]
        )
        return torch.argmax(logp + noise, dim=-1)


def mix(*values: int) -> int:
    """A 63-bit hash of integers (splitmix64 steps), stable across processes and runs."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return h & _MASK


def gumbel(key: int, position: int, vocab: int) -> torch.Tensor:
    """G_t [V]: i.i.d. standard Gumbel noise, a pure function of (key, position)."""
    gen = torch.Generator().manual_seed(mix(key, position))
    u = torch.rand(vocab, generator=gen, dtype=torch.float64).clamp_(1e-300, 1.0 - 1e-16)
    return -torch.log(-torch.log(u))


def processed_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """log p after temperature, top-k and top-p (nucleus) filtering; -inf outside the support.

    logits [n, V] -> [n, V] float64. Top-p keeps the smallest set of most likely tokens whose
    mass reaches top_p (the token that crosses the threshold is kept).
    """
    x = logits.double() / temperature
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly before each token
        drop = before >= top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, idx, sorted_x)
    return torch.log_softmax(x, dim=-1)
