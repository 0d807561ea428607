"""Prompt lookup (n-gram) drafting: no model, nearly free, strong where output copies input."""

from __future__ import annotations

from collections.abc import Sequence


def lookup_continuation(seq: Sequence[int], ngram: int, limit: int) -> list[int]:
    """The tokens that followed the latest earlier occurrence of seq's last ``ngram`` tokens.

    Searches from the most recent occurrence backwards; returns up to ``limit`` tokens, or []
    when the n-gram never occurred before (or nothing followed it).
    """
    n = len(seq)
    if n <= ngram or limit <= 0:
        return []
    key = list(seq[n - ngram :])
    for start in range(n - ngram - 1, -1, -1):
        if list(seq[start : start + ngram]) == key:
            cont = list(seq[start + ngram : start + ngram + limit])
            if cont:
                return cont
    return []


class PromptLookup:
    def __init__(self, name: str, ngram: int, max_proposal: int) -> None:
        self.name = name
        self.ngram = ngram
        self.max_proposal = max_proposal

    def learn(self, output: Sequence[int], store_key: str) -> None:
        """Nothing to learn: a lookup drafts from its own sequence only."""

    def for_slot(self) -> PromptLookup:
        """Another sequence (a slot of batched decoding): a lookup keeps no state between calls."""
        return self

    def prefill(self, prompt: Sequence[int], room: int = 0, store_key: str = "") -> None:
        pass

    def propose(self, seq: Sequence[int], limit: int, confirmed: int | None = None) -> list[int]:
        return lookup_continuation(seq, self.ngram, min(limit, self.max_proposal))

    def end_sequence(self, output: Sequence[int]) -> dict:
        return {}
