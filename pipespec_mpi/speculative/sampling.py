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
        """The stage's choice at positions first_position.. for logits [n, V] -> ids [n], on the
        logits' device (the noise is made there: ``gumbel``)."""
        if self.greedy:
            return torch.argmax(logits, dim=-1)
        r = self.rule
        logp = processed_logprobs(logits, r.temperature, r.top_k, r.top_p)
        return torch.argmax(logp + gumbel(self.key, first_position, logp.shape, logp.device), dim=-1)


def mix(*values: int) -> int:
    """A 63-bit hash of integers (splitmix64 steps), stable across processes and runs."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return h & _MASK


def _signed(v: int) -> int:
    """A 64-bit pattern as torch's int64 holds it."""
    return v - (1 << 64) if v >= 1 << 63 else v


_GOLDEN, _M1, _M2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _finish(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function on int64 tensors (products wrap; shifts made logical)."""
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _M1
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _M2
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def gumbel(
    key: int, first_position: int, shape: torch.Size, device: torch.device | None = None
) -> torch.Tensor:
    """G [n, V] float64 for positions first_position.. (rows) and token ids (columns): i.i.d.
    standard Gumbel noise, each value a pure function of (key, position, token), computed on
    ``device`` by integer hashing, so every device and every stage draws the same noise."""
    n, vocab = shape
    dev = device if device is not None else torch.device("cpu")
    pos = torch.arange(first_position, first_position + n, device=dev, dtype=torch.int64)
    row = _finish(pos[:, None] * _GOLDEN + _signed(mix(key)))  # [n, 1]: a SplitMix64 seed per position
    h = _finish(row + torch.arange(1, vocab + 1, device=dev, dtype=torch.int64)[None, :] * _GOLDEN)
    u = (((h >> 11) & ((1 << 53) - 1)).double() + 0.5) * 2.0**-53  # in (0, 1): 53 bits of h
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


def speculative_verify(
    proposal: torch.Tensor, q: torch.Tensor, p: torch.Tensor, gen: torch.Generator
) -> torch.Tensor:
    """Leviathan/Chen verification of ``proposal`` (ids [n]) drawn from q [n, V], against the
    verifier's p [n+1, V], on their device with no host read: [2] = (n_accepted, next token),
    the token drawn from the residual max(0, p - q) at the first rejection, or the bonus token
    drawn from p[n] (n = 0: a draw from p[0])."""
    n = proposal.shape[0]
    u = torch.rand(n, generator=gen, device=p.device, dtype=p.dtype)
    px = p[:n].gather(1, proposal[:, None])[:, 0]
    qx = q.gather(1, proposal[:, None])[:, 0].to(p.dtype)
    ok = (qx > 0) & (u * qx < px)  # u < min(1, p(x)/q(x))
    m = ok.long().cumprod(0).sum()
    # the row at the first rejection, or the bonus row (q of zeros: its residual is p[n]);
    # index_select, not p[m]: indexing by a tensor scalar reads it on the host
    at = m.view(1)
    p_m = p.index_select(0, at)[0]
    q_m = torch.cat((q.to(p.dtype), q.new_zeros(1, q.shape[1], dtype=p.dtype))).index_select(0, at)[0]
    residual = (p_m - q_m).clamp_(min=0)
    total = residual.sum()
    # total == 0 only if p == q, where a rejection cannot happen; guard against rounding
    row = torch.where(total > 0, residual / total.clamp(min=torch.finfo(p.dtype).tiny), p_m)
    return torch.stack((m, torch.multinomial(row, 1, generator=gen)[0]))
