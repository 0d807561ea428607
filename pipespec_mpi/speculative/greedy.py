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

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipespec_mpi.speculative.transfer import read, upload


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


def verdicts(proposals: Sequence[list[int]], targets: Sequence[torch.Tensor]) -> list[Verdict]:
    """The verdicts of B verifications, ``proposals[b]`` (n_b ids) against ``targets[b]``
    ([n_b+1] on one device: the verifier's own token at each row), in one batched ``accept``: one
    upload of the proposals and one host read for all (n_b = 0: the verifier's own next token).

    targets[b][j] is the verifier's token for position L+j given the committed prefix and
    proposal[:j] (its argmax, or its Gumbel-perturbed argmax when sampling); proposal[j] is
    accepted iff it equals targets[b][j] and all before it were accepted.
    """
    for prop, target in zip(proposals, targets, strict=True):
        if target.shape != (len(prop) + 1,):
            raise ValueError(
                f"need n+1={len(prop) + 1} target tokens for {len(prop)} proposed, got {target.shape[0]}"
            )
    k = max(map(len, proposals))
    host = torch.tensor([[len(p), *p, *[0] * (k - len(p))] for p in proposals], dtype=torch.long)
    table = upload(host, targets[0].device)  # [B, 1 + K]: each count, then its proposal (padded)
    target = torch.stack([F.pad(t.long(), (0, k + 1 - t.shape[0])) for t in targets])
    rows = read(accept(table[:, 1:], table[:, 0], target))  # the one host read
    return [Verdict(len(p), m, nxt) for p, (m, nxt) in zip(proposals, rows, strict=True)]


def verify_against(proposal: list[int], target: torch.Tensor) -> Verdict:
    """Verify ``proposal`` (n ids) against the verifier's own choices target [n+1] (``verdicts``)."""
    return verdicts([proposal], [target])[0]


def greedy_verify(proposal: list[int], logits: torch.Tensor) -> Verdict:
    """Greedy verification from the verifier's logits [n+1, V]."""
    if logits.shape[0] != len(proposal) + 1:
        raise ValueError(
            f"need n+1={len(proposal) + 1} rows of logits for {len(proposal)} proposed tokens, "
            f"got {logits.shape[0]}"
        )
    return verify_against(proposal, greedy_tokens(logits))
