"""Verification rules as objects: what a stage draws on its own and how it checks proposals.

A stage never branches on the decoding rule; it holds one ``Verifier`` and asks it two things:

  draw(logits, position)                  its own token after a committed prefix (a draft step of
                                          the first stage, or a verifier's own step)
  verify(proposal, dists, logits, position)
                                          a proposal of n tokens for positions position.. checked
                                          against the stage's logits [n+1, V]: a ``Verdict`` (the
                                          accepted prefix, then the recovered or bonus token)

Both also return the distribution each emitted token was drawn from when proposals must carry it
(``carries_dists``: Leviathan sampling, where the next verifier needs q). ``resendable`` says whether
a proposal may travel downstream twice: the greedy and Gumbel rules verify deterministically (a
second look at the same draft in the same context gives the same verdict), the Leviathan rule
does not (a draft rejected once and offered again would get a second chance: a bias).

Rules: ``Greedy`` (argmax), ``Gumbel`` (shared per-position noise, reproducible), ``Leviathan``
(min(1, p/q) and the residual); ``AcceptAll`` wraps a rule and accepts every proposal: a broken
verifier that the statistical tests pass in to show that they detect one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from pipespec_mpi.speculative.greedy import Verdict, greedy_verify, verify_against
from pipespec_mpi.speculative.sampling import Sampler, draw, mix, speculative_verify


@dataclass(frozen=True)
class Drawn:
    token: int
    dist: np.ndarray | None = None  # [V] float32: what the token was drawn from (carries_dists)


@dataclass(frozen=True)
class Checked:
    verdict: Verdict
    dists: list[np.ndarray] | None = None  # per committed token (accepted..., next): p at each


class Verifier(Protocol):
    carries_dists: bool
    resendable: bool

    def draw(self, logits: torch.Tensor, position: int) -> Drawn:
        """logits [1, V] after the committed prefix -> the stage's token at ``position``."""

    def verify(
        self, proposal: list[int], dists: Sequence[np.ndarray] | None, logits: torch.Tensor, position: int
    ) -> Checked:
        """proposal [n] for positions position.., their q rows [n][V] (or None), logits [n+1, V]."""

    def point_masses(self, tokens: list[int], vocab: int) -> list[np.ndarray] | None:
        """The distributions of deterministic proposals (prompt lookup), if they must travel."""


class Greedy:
    """Argmax: the committed tokens are exactly the stage's own greedy choices."""

    carries_dists = False
    resendable = True

    def draw(self, logits: torch.Tensor, position: int) -> Drawn:
        return Drawn(int(torch.argmax(logits[-1])))

    def verify(self, proposal, dists, logits, position) -> Checked:
        return Checked(greedy_verify(proposal, logits))

    def point_masses(self, tokens, vocab):
        return None


class Gumbel:
    """The stage's choice at position t is argmax(log p + G_t), G_t shared by every stage."""

    carries_dists = False
    resendable = True

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def draw(self, logits: torch.Tensor, position: int) -> Drawn:
        return Drawn(int(self.sampler.tokens(logits[-1:], position)[0]))

    def verify(self, proposal, dists, logits, position) -> Checked:
        return Checked(verify_against(proposal, self.sampler.tokens(logits, position)))

    def point_masses(self, tokens, vocab):
        return None


class Leviathan:
    """Speculative sampling: accept x ~ q with probability min(1, p(x)/q(x)), else draw from the
    residual max(0, p - q); every emitted token is distributed as p and travels with it."""

    carries_dists = True
    resendable = False

    def __init__(self, sampler: Sampler, stage: int) -> None:
        self.sampler = sampler
        # fresh randomness per decision, from a per-stage stream (seed, prompt, sample, stage)
        self.gen = torch.Generator().manual_seed(mix(sampler.key, stage))

    def draw(self, logits: torch.Tensor, position: int) -> Drawn:
        p = self.sampler.probs(logits[-1:])[0].cpu()  # [V]: what travels with the token (one copy)
        return Drawn(draw(p, self.gen), p.float().numpy())

    def verify(self, proposal, dists, logits, position) -> Checked:
        n = len(proposal)
        p = self.sampler.probs(logits).cpu()  # [n+1, V]: the rows that travel on (one copy)
        if n and dists is None:
            raise ValueError("leviathan verification needs the distribution of every proposed token")
        q = torch.from_numpy(np.stack(dists[:n])).double()[:, : p.shape[1]] if n else p[:0]  # [n, V]
        m, nxt = speculative_verify(proposal, q, p, self.gen)
        return Checked(Verdict(n, m, nxt), [p[j].float().numpy() for j in range(m + 1)])

    def point_masses(self, tokens, vocab):
        rows = []
        for tok in tokens:
            row = np.zeros(vocab, dtype=np.float32)
            row[tok] = 1.0
            rows.append(row)
        return rows


class AcceptAll:
    """A broken rule for tests: accepts every proposal, then draws its next token as ``inner``."""

    def __init__(self, inner: Verifier) -> None:
        self.inner = inner
        self.carries_dists = inner.carries_dists
        self.resendable = inner.resendable

    def draw(self, logits: torch.Tensor, position: int) -> Drawn:
        return self.inner.draw(logits, position)

    def verify(self, proposal, dists, logits, position) -> Checked:
        n = len(proposal)
        nxt = self.inner.draw(logits[n : n + 1], position + n)
        rows = None
        if self.carries_dists:
            p = self.inner.sampler.probs(logits[:n]).cpu()
            rows = [*(p[j].float().numpy() for j in range(n)), nxt.dist]
        return Checked(Verdict(n, n, nxt.token), rows)

    def point_masses(self, tokens, vocab):
        return self.inner.point_masses(tokens, vocab)


def make_verifier(sampler: Sampler, stage: int) -> Verifier:
    """The rule a stage uses under ``sampler``: greedy at temperature 0, else its coupling."""
    if sampler.greedy:
        return Greedy()
    if sampler.coupling == "gumbel":
        return Gumbel(sampler)
    return Leviathan(sampler, stage)
