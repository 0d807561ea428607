"""Per committed token: its compute cost and how far ahead of the downstream it was committed,
so a rollback prices what it threw away and the policy learns which run-ahead survives."""

from __future__ import annotations


class Ledger:
    """One entry per token the stage holds; ``fated``: the tokens before it had their fate
    (kept or thrown away by the downstream) given out (``judged``)."""

    def __init__(self) -> None:
        self.cost: list[float] = []  # compute seconds per token
        self.ahead: list[int] = []  # how far ahead of the downstream it was committed (0: adopted)
        self.fated = 0

    def committed(self, length: int, down_length: int, n: int, cost_s: float) -> None:
        """``n`` tokens committed after our first ``length``, the downstream holding ``down_length``."""
        ahead0 = length - down_length
        self.ahead.extend(range(ahead0 + 1, ahead0 + 1 + n))
        self.cost.extend([cost_s / max(1, n)] * n)

    def adopted(self, keep: int, length: int) -> float:
        """Ours kept up to ``keep``, the downstream's after it (``length`` in all): the compute
        seconds of the tokens thrown away."""
        thrown_s = sum(self.cost[keep:])
        self.ahead = self.ahead[:keep] + [0] * (length - keep)
        self.cost = self.cost[:keep] + [0.0] * (length - keep)
        return thrown_s

    def judged(self, keep: int, confirmed: int, thrown_to: int = 0) -> list[tuple[int, bool]]:
        """The fates of the tokens the downstream has judged since the last call, as (how far
        ahead it was committed, kept), in order: kept up to ``confirmed``, thrown away from
        ``keep`` to ``thrown_to`` (the length before a rollback). Adopted tokens have none."""
        kept = [(self.ahead[i], True) for i in range(self.fated, confirmed) if self.ahead[i] > 0]
        thrown = [
            (self.ahead[i], False) for i in range(max(self.fated, keep), thrown_to) if self.ahead[i] > 0
        ]
        self.fated = min(max(self.fated, confirmed), keep)
        return kept + thrown
