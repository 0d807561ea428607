"""Verification rules as objects: how a stage checks a proposal and picks its own tokens.

A stage never branches on the decoding rule; it holds one ``Verifier`` and hands each forward's
logits to ``check_all`` as a ``Question``: a proposal of n tokens for positions position..,
checked against the stage's logits [n+1, V] (n = 0: the stage's own next token, a draft step or
a verifier's own step). The answer is a ``Checked``: a ``Verdict`` (the accepted prefix, then the
recovered or bonus token) and, when proposals must carry them (``carries_dists``: Leviathan
sampling, where the next verifier needs q), the distribution each emitted token was drawn from.

The rules that verify by equality (greedy, Gumbel) only name their own token per row
(``choices``, on the logits' device); ``check_all`` answers all of a batched forward's questions
in one batched accept and one host read. Leviathan decides in ``verify`` (on the device; its
rows still travel through the host). ``resendable`` says whether a proposal may travel downstream
twice: the greedy and Gumbel rules verify deterministically (a second look at the same draft in
the same context gives the same verdict), the Leviathan rule does not (a draft rejected once and
offered again would get a second chance: a bias).

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

from pipespec_mpi.speculative.greedy import Verdict, verdicts
from pipespec_mpi.speculative.sampling import Sampler, mix, speculative_verify
from pipespec_mpi.speculative.transfer import read, upload


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

    def choices(self, logits: torch.Tensor, position: int) -> torch.Tensor | None:
        """ids [n+1] on the logits' device: the stage's own token at each row of logits [n+1, V]
        for positions position.. (rules that verify by equality), or None (``verify`` decides)."""

    def verify(
        self, proposal: list[int], dists: Sequence[np.ndarray] | None, logits: torch.Tensor, position: int
    ) -> Checked:
        """proposal [n] for positions position.., their q rows [n][V] (or None), logits [n+1, V]."""

    def point_masses(self, tokens: list[int], vocab: int) -> list[np.ndarray] | None:
        """The distributions of deterministic proposals (prompt lookup), if they must travel."""


@dataclass(frozen=True)
class Question:
    """One forward's check: ``proposal`` [n] for positions ``position``.. against ``logits``
    [n+1, V], with the proposal's q rows where the rule needs them."""

    verifier: Verifier
    proposal: list[int]
    logits: torch.Tensor
    position: int
    dists: Sequence[np.ndarray] | None = None


def check_all(questions: Sequence[Question]) -> list[Checked]:
    """Every question's answer; those of rules that verify by equality in one batched accept
    with one host read for all of them (``greedy.verdicts``)."""
    out: list[Checked | None] = [None] * len(questions)
    equal: list[int] = []
    targets: list[torch.Tensor] = []
    for i, q in enumerate(questions):
        t = q.verifier.choices(q.logits, q.position)
        if t is None:
            out[i] = q.verifier.verify(q.proposal, q.dists, q.logits, q.position)
        else:
            equal.append(i)
            targets.append(t)
    if equal:
        for i, v in zip(equal, verdicts([questions[i].proposal for i in equal], targets), strict=True):
            out[i] = Checked(v)
    return out  # type: ignore[return-value]


def own_token(verifier: Verifier, logits: torch.Tensor, position: int) -> Drawn:
    """The stage's own token at ``position`` after a committed prefix, from its last row of logits."""
    c = check_all([Question(verifier, [], logits[-1:], position)])[0]
    return Drawn(c.verdict.next_token, c.dists[0] if c.dists else None)


class _ByEquality:
    """A rule whose verdict is the longest prefix equal to its own choices."""

    carries_dists = False
    resendable = True

    def choices(self, logits: torch.Tensor, position: int) -> torch.Tensor:
        raise NotImplementedError

    def verify(self, proposal, dists, logits, position) -> Checked:
        return check_all([Question(self, proposal, logits, position)])[0]

    def point_masses(self, tokens, vocab):
        return None


class Greedy(_ByEquality):
    """Argmax: the committed tokens are exactly the stage's own greedy choices."""

    def choices(self, logits: torch.Tensor, position: int) -> torch.Tensor:
        return torch.argmax(logits, dim=-1)


class Gumbel(_ByEquality):
    """The stage's choice at position t is argmax(log p + G_t), G_t shared by every stage."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def choices(self, logits: torch.Tensor, position: int) -> torch.Tensor:
        return self.sampler.tokens(logits, position)


class Leviathan:
    """Speculative sampling: accept x ~ q with probability min(1, p(x)/q(x)), else draw from the
    residual max(0, p - q); every emitted token is distributed as p and travels with it."""

    carries_dists = True
    resendable = False

    def __init__(self, sampler: Sampler, stage: int) -> None:
        self.sampler = sampler
        # fresh randomness per decision, from a per-stage stream (seed, prompt, sample, stage),
        # made on the device of the logits it first decides on
        self.seed = mix(sampler.key, stage)
        self.gen: torch.Generator | None = None

    def choices(self, logits: torch.Tensor, position: int) -> None:
        return None

    def verify(self, proposal, dists, logits, position) -> Checked:
        n = len(proposal)
        if n and dists is None:
            raise ValueError("leviathan verification needs the distribution of every proposed token")
        p = self.sampler.probs(logits)  # [n+1, V] float64, on the logits' device
        dev, vocab = p.device, p.shape[1]
        q = upload(torch.from_numpy(np.stack(dists[:n]))[:, :vocab], dev) if n else p.new_zeros(0, vocab)
        prop = upload(torch.tensor(proposal, dtype=torch.long), dev)
        m, nxt = read(speculative_verify(prop, q, p, self._generator(dev)))
        rows = p[: m + 1].float().cpu().numpy()  # what travels on with the committed tokens
        return Checked(Verdict(n, m, nxt), list(rows))

    def _generator(self, device: torch.device) -> torch.Generator:
        if self.gen is None:
            self.gen = torch.Generator(device="cpu" if device.type == "meta" else device)
            self.gen.manual_seed(self.seed)
        return self.gen

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

    def choices(self, logits: torch.Tensor, position: int) -> None:
        return None

    def verify(self, proposal, dists, logits, position) -> Checked:
        n = len(proposal)
        nxt = own_token(self.inner, logits[n : n + 1], position + n)
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
