"""Pure bookkeeping of a stage's token buffers (no MPI, no torch).

A stage owns ``committed``: the generated tokens it has verified (or, for the first stage,
drafted). Positions are counted from the first generated token. A verifying stage also keeps an
``Inbox`` of proposal tokens received from its upstream for positions len(committed) onwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass(frozen=True)
class Adoption:
    """Result of aligning a stage with its downstream's committed tokens."""

    tokens: list[int]  # the stage's new committed tokens
    keep: int  # how many of the old tokens survive (the KV cache is cut to this)
    discarded: int  # old tokens thrown away (rollback)


def adopt(own: Sequence[int], downstream: Sequence[int]) -> Adoption:
    """Roll ``own`` back to agree with the downstream's committed tokens.

    The downstream's tokens are authoritative where both exist. Own tokens beyond the end of the
    downstream's are kept only if everything before them agreed (they are still valid drafts).
    """
    p = common_prefix(own, downstream)
    if p == len(downstream):  # downstream is a prefix of own: nothing to correct
        return Adoption(tokens=list(own), keep=len(own), discarded=0)
    return Adoption(tokens=list(own[:p]) + list(downstream[p:]), keep=p, discarded=len(own) - p)


def adopt_sent_once(own: Sequence[int], downstream: Sequence[int], sent: int) -> Adoption:
    """``adopt`` after the downstream changed epoch, where a token travels at most once (Leviathan:
    what we sent beyond the downstream's tokens may have been verified there, and offered again it
    would get a second chance, a bias): own tokens beyond the downstream's are kept only while
    none of them was sent (``sent``: how many of ours the downstream was sent)."""
    a = adopt(own, downstream)
    if sent <= len(downstream):
        return a
    keep = min(a.keep, len(downstream))
    return Adoption(tokens=a.tokens[: len(downstream)], keep=keep, discarded=len(own) - keep)


@dataclass
class Inbox:
    """Proposal tokens from upstream for positions ``base .. base+len(tokens)-1``."""

    tokens: list[int] = field(default_factory=list)
    rows: list = field(default_factory=list)  # sampling: the distribution of each token (or [])

    def clear(self) -> None:
        self.tokens.clear()
        self.rows.clear()

    def merge(
        self, committed: Sequence[int], start: int, proposal: Sequence[int], rows: Sequence | None = None
    ) -> bool:
        """Fold a proposal for positions start.. into the inbox (base = len(committed)).

        Positions already committed must agree with ``committed``; a disagreement means the
        upstream has diverged from this stage (its tokens there are stale) and returns False,
        leaving the inbox empty: the caller must signal a rollback upstream. Positions already in
        the inbox are overwritten (the newer proposal wins); a gap returns False as well.
        """
        base = len(committed)
        end_known = base + len(self.tokens)
        if start > end_known:
            self.clear()
            return False
        for k, tok in enumerate(proposal):
            pos = start + k
            row = None if rows is None else rows[k]
            if pos < base:
                if committed[pos] != tok:
                    self.clear()
                    return False
            elif pos - base < len(self.tokens):
                if self.tokens[pos - base] != tok:
                    del self.tokens[pos - base :]
                    self.tokens.append(tok)
                    if rows is not None:
                        del self.rows[pos - base :]
                        self.rows.append(row)
            else:
                self.tokens.append(tok)
                if rows is not None:
                    self.rows.append(row)
        return True

    def advance(self, committed_now: Sequence[int], n_old: int) -> bool:
        """Re-base after the stage committed tokens at positions n_old.. (verify / own step).

        Inbox tokens for positions that are now committed are dropped if they agree; a
        disagreement empties the inbox and returns False (the upstream went another way).
        """
        n_new = len(committed_now) - n_old
        head = self.tokens[:n_new]
        if head != list(committed_now[n_old : n_old + len(head)]):
            self.clear()
            return False
        del self.tokens[:n_new]
        del self.rows[:n_new]
        return True
