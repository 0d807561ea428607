"""Sampling that stays exact through an asynchronous hierarchy. Two verification rules:

``leviathan`` (default): speculative sampling (Leviathan et al. 2023; Chen et al. 2023) at every
verifying stage. A proposed token x, drawn by the proposing stage from q, is accepted with
probability min(1, p(x)/q(x)), p being the verifier's distribution after the same
temperature/top-k/top-p processing; at the first rejection the verifier draws from the normalised
residual max(0, p - q); when all are accepted it draws a bonus token from p. Every token a stage
emits is then distributed as that stage's own p, so it travels downstream with p as the q the next
verifier needs (full float32 rows: 4 V bytes per token). Randomness is fresh per decision (a
per-stage stream seeded from (seed, prompt, sample index, stage)); the output is exactly
distributed as the last model's sampling, but which sample a run draws depends on the
asynchronous schedule (ar and sd are reproducible from the seed; pipespec is not).

``gumbel``: shared per-position Gumbel noise (below). Lower acceptance than min(1, p/q), but
reproducible token for token whatever the timing, and nothing but token ids travels.

The ``gumbel`` rule in detail:

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

from dataclasses import dataclass, field

import torch

from pipespec_mpi.config import SamplingConfig

_MASK = (1 << 63) - 1


@dataclass(frozen=True)
class Sampler:
    """A job's sampling: the rule (``SamplingConfig``: temperature, top-k, top-p, coupling) and
    the key of its noise, (seed, prompt, sample index) mixed into one integer by the runner."""

    rule: SamplingConfig = field(default_factory=SamplingConfig)
    key: int = 0

    @property
    def greedy(self) -> bool:
        return self.rule.temperature <= 0.0

    @property
    def leviathan(self) -> bool:
        return not self.greedy and self.rule.coupling == "leviathan"

    @property
    def coupling(self) -> str:
        return self.rule.coupling

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """p [n, V] (float64) after temperature / top-k / top-p."""
        r = self.rule
        return processed_logprobs(logits, r.temperature, r.top_k, r.top_p).exp()

    def tokens(self, logits: torch.Tensor, first_position: int) -> torch.Tensor:
        """The stage's choice at positions first_position.. for logits [n, V] -> ids [n]."""
        if self.greedy:
            return torch.argmax(logits, dim=-1)
        r = self.rule
        logp = processed_logprobs(logits, r.temperature, r.top_k, r.top_p)
        noise = torch.stack(
            [gumbel(self.key, first_position + i, logits.shape[-1]) for i in range(logits.shape[0])]
        )  # made on the host: every stage draws the same noise, whatever its device
        return torch.argmax(logp + noise.to(logp.device), dim=-1)


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


def draw(p: torch.Tensor, gen: torch.Generator) -> int:
    """One token from the distribution p [V]."""
    return int(torch.multinomial(p, 1, generator=gen))


def speculative_verify(
    proposal: list[int], q: torch.Tensor, p: torch.Tensor, gen: torch.Generator
) -> tuple[int, int]:
    """Leviathan/Chen verification of ``proposal`` (n ids) drawn from q [n, V], against the
    verifier's p [n+1, V]. Returns (n_accepted, next token): the token drawn from the residual
    max(0, p - q) at the first rejection, or the bonus token drawn from p[n]."""
    for j, x in enumerate(proposal):
        px, qx = float(p[j, x]), float(q[j, x])
        u = float(torch.rand((), generator=gen, dtype=torch.float64))
        if qx > 0 and u < min(1.0, px / qx):
            continue
        residual = (p[j] - q[j]).clamp_(min=0)
        total = float(residual.sum())
        # total == 0 only if p == q, where a rejection cannot happen; guard against rounding
        return j, draw(residual / total if total > 0 else p[j], gen)
    return len(proposal), draw(p[len(proposal)], gen)
