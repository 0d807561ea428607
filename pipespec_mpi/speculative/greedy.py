"""Greedy verification as pure tensor functions (no communication, testable on CPU).

Terms, used the same way everywhere in the package:
  proposal   draft tokens a stage receives from its upstream, positions L .. L+n-1
  accepted   the longest prefix of the proposal equal to the verifier's own argmax
  recovered  the verifier's argmax at the first mismatch (the correction)
  bonus      the verifier's argmax after a fully accepted proposal
Either the recovered or the bonus token is appended, so a verification of n tokens commits
between 1 and n+1 tokens, and the committed tokens are exactly the verifier's own greedy choices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    n_proposed: int
    n_accepted: int
    next_token: int  # recovered (n_accepted < n_proposed) or bonus (all accepted)

    @property
    def rejected(self) -> bool:
        return self.n_accepted < self.n_proposed

    def committed(self, proposal: list[int]) -> list[int]:
        return [*proposal[: self.n_accepted], self.next_token]


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits [n, V] -> argmax ids [n] (ties resolve to the lowest id, deterministically)."""
    return torch.argmax(logits, dim=-1)


def accept(proposal: torch.Tensor, count: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The verdicts of B verifications at once, on the device (no host sync): proposal [B, K]
    (padded), count [B] (how many are real), target [B, K+1] (each verifier's own choices)
    -> [B, 2]: the accepted prefix length and the recovered or bonus token."""
    k = proposal.shape[1]
    real = torch.arange(k, device=proposal.device)[None, :] < count[:, None]
    accepted = ((proposal == target[:, :k]) & real).long().cumprod(dim=1).sum(dim=1)
    return torch.stack((accepted, target.gather(1, accepted[:, None])[:, 0]), dim=1)


def verify_against(proposal: list[int], target: torch.Tensor) -> Verdict:
    """Verify ``proposal`` (n ids) against the verifier's own choices target [n+1].

    target[j] is the verifier's token for position L+j given the committed prefix and
    proposal[:j] (its argmax, or its Gumbel-perturbed argmax when sampling); proposal[j] is
    accepted iff it equals target[j] and all before it were accepted.
    """
    n = len(proposal)
    if target.shape[0] != n + 1:
        raise ValueError(f"need n+1={n + 1} target tokens for {n} proposed, got {target.shape[0]}")
    prop = torch.as_tensor(proposal, dtype=target.dtype).to(target.device)[None, :]
    m, nxt = accept(prop, torch.full((1,), n, device=target.device), target[None, :])[0].tolist()
    return Verdict(n_proposed=n, n_accepted=m, next_token=nxt)  # the one host transfer


def greedy_verify(proposal: list[int], logits: torch.Tensor) -> Verdict:
    """Greedy verification from the verifier's logits [n+1, V]."""
    if logits.shape[0] != len(proposal) + 1:
        raise ValueError(
            f"need n+1={len(proposal) + 1} rows of logits for {len(proposal)} proposed tokens, "
            f"got {logits.shape[0]}"
        )
    return verify_against(proposal, greedy_tokens(logits))
