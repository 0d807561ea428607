"""Suffix drafting (``kind: suffix``): no model, a draft at nearly every step.

Prompt lookup copies what followed the latest earlier occurrence of the last 3 tokens, and has
nothing to say when those 3 tokens are new, which on unseen text is most of the time
(docs/notebook.md, "Measurements behind the code's choices"). A suffix drafter matches the
longest suffix of the text so far (up to ``max_match`` tokens, down to one) against three
sources, and follows the most frequent continuation of all the places it matched, as
SuffixDecoding (arXiv 2411.04975) does with suffix trees:

  sequence  the prompt and the tokens committed so far (rolled back with them)
  job       the outputs this replica has finished in this job (``store_tokens`` at most, the
            oldest dropped first): every finished sequence is a corpus for the next
  corpus    a user's text file, tokenized once (``corpus``; ``store_tokens`` at most)

Notation (one proposal):
  m         the match length: how many trailing tokens of the text the matched places share
  f_j       the share of the matched places, among those still agreeing with the draft's first
            j tokens, whose next token is the draft's token j (the continuation's frequency)
  q_j       the estimated probability that the verifier accepts token j given that it accepted
            tokens 0..j-1: an exponential average of what verifiers did with earlier tokens of the
            same cell (source, min(m, 4), f_j >= 0.99 | >= 0.5 | below), from a prior
  S_0       the survival probability of the drafter's own tokens not yet confirmed that the draft
            extends (prod of their q; 1 when it extends confirmed text): a stage 0 keeps drafting
            on top of its unverified drafts, and a token is worth only as much as the chance that
            everything before it survives
  S_j       S_0 prod_{i<=j} q_i, the survival probability of token j; the draft stops before the
            first token with S_j < ``min_survival``
  E         sum_j S_j, the expected number of accepted tokens
Every source drafts; the proposal is the one with the largest E (the combination). The estimates
learn from the verifier's committed tokens (``confirmed``: the prefix of the sequence the next
stage has committed): a proposed token is accepted where the committed token equals it. Two
rules keep the estimates honest, whatever the timing:
  - a draft made on a context that was rolled back (it extended tokens the verifier replaced) is
    forgotten unjudged: the verifier never saw it, and comparing it with what was committed in its
    place would count the rollback against its cell;
  - a cell whose q is below ``min_survival`` is never proposed from, so never observed again: each
    time it cuts a draft its q drifts towards the prior (``UNTRIED`` of a rejection's weight), so
    that it is tried again now and then instead of staying shut for the rest of the job. Without
    the drift, which cells shut early in a job decided its speed (docs/notebook.md, "Measurements
    behind the code's choices").

The index is two hash maps (last token, last two tokens) -> positions whose continuation starts
there; a match is grown backwards from each of the most recent ``max_candidates`` positions. Each
committed token adds two entries and each token rolled back removes two (the lists are in
position order, so its entries are the last ones).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("pipespec_mpi")

SOURCES = ("sequence", "job", "corpus")
SEP = -1  # between documents of a store: equals no token, so no match or continuation crosses it
EMA = 0.05  # weight of one observed token in a cell's acceptance estimate
# q before any observation, by match bucket (1, 2, 3, 4+) for a continuation every matched
# place agrees on; a split continuation starts at f_j times that
PRIOR = (0.35, 0.5, 0.65, 0.8)
UNTRIED = 0.2  # a cut by a cell below the bound moves its q towards the prior by UNTRIED * EMA


def _pair(a: int, b: int) -> int:
    return (a << 32) | (b & 0xFFFFFFFF)


class TokenIndex:
    """Positions of every token and token pair of a text, for longest-suffix matching.

    ``text`` is append-and-truncate; ``one[t]`` holds the positions p with text[p-1] == t and
    ``two[(a, b)]`` those with text[p-2:p] == [a, b], in increasing order. A position p is where a
    continuation starts (text[p] when p < len(text)).
    """

    def __init__(self) -> None:
        self.text: list[int] = []
        self.one: dict[int, list[int]] = {}
        self.two: dict[int, list[int]] = {}
        self.base = 0  # positions below it were dropped (a store's oldest documents)

    def __len__(self) -> int:
        return self.base + len(self.text)

    def at(self, p: int) -> int:
        return self.text[p - self.base]

    def append(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.text.append(t)
            p = len(self)
            if t == SEP:
                continue
            self.one.setdefault(t, []).append(p)
            if len(self.text) >= 2 and self.text[-2] != SEP:
                self.two.setdefault(_pair(self.text[-2], t), []).append(p)

    def truncate(self, length: int) -> None:
        """Cut the text back to ``length`` tokens (no-op if shorter)."""
        while len(self) > length:
            p = len(self)
            t = self.text.pop()
            if t == SEP:
                continue
            _pop_last(self.one, t, p)
            if self.text and self.text[-1] != SEP:
                _pop_last(self.two, _pair(self.text[-1], t), p)

    def drop_front(self, upto: int) -> None:
        """Forget positions below ``upto`` (a store's oldest documents; ``upto`` is a position
        just after a separator, so no remaining pair starts before it)."""
        upto = min(upto, len(self))
        for k in range(self.base, upto):
            t = self.text[k - self.base]
            if t == SEP:
                continue
            _pop_first(self.one, t, k + 1)
            if k > self.base and self.text[k - 1 - self.base] != SEP:
                _pop_first(self.two, _pair(self.text[k - 1 - self.base], t), k + 1)
        del self.text[: upto - self.base]
        self.base = upto

    def candidates(self, query: Sequence[int], limit: int, exclude: int = -1) -> tuple[int, list[int]]:
        """The longest match of ``query``'s suffix: (m, the positions where it continues), the
        most recent ``limit`` positions that share its last two tokens (or, failing that, its last
        one) examined. ``exclude``: a position never returned (the query's own end)."""
        if not query:
            return 0, []
        if len(query) >= 2:
            m, found = self._grow(self.two.get(_pair(query[-2], query[-1])), query, limit, exclude)
            if found:
                return m, found
        return self._grow(self.one.get(query[-1]), query, limit, exclude)

    def _grow(
        self, pos: list[int] | None, query: Sequence[int], limit: int, exclude: int
    ) -> tuple[int, list[int]]:
        best: int = 0
        found: list[int] = []
        if not pos:  # (a pair seen only at the query's own end leaves nothing: then the last token)
            return best, found
        n, lo = len(query), self.base
        for p in reversed(pos[-limit - 1 :]):
            if p == exclude:
                continue
            m = 1
            while m < n and p - m - 1 >= lo and self.text[p - m - 1 - lo] == query[n - m - 1]:
                m += 1
            if m > best:
                best, found = m, [p]
            elif m == best:
                found.append(p)
        return best, found  # most recent first


MAX_MATCH_CAP = 64  # ``max_match`` is clamped to this (a query is never longer than max_match)


def _pop_last(table: dict[int, list[int]], key: int, p: int) -> None:
    lst = table[key]
    assert lst[-1] == p, (key, p, lst[-1])
    lst.pop()
    if not lst:
        del table[key]


def _pop_first(table: dict[int, list[int]], key: int, p: int) -> None:
    lst = table.get(key)
    if lst is None:
        return
    i = bisect.bisect_right(lst, p)
    del lst[:i]
    if not lst:
        del table[key]


def continuation(
    index: TokenIndex, places: Sequence[int], end: int, limit: int
) -> tuple[list[int], list[float]]:
    """The most frequent continuation of ``places`` (most recent first), up to ``limit`` tokens,
    and each token's f_j; a place stops at ``end`` (the query's own end), at a separator or at the
    end of the text."""
    out: list[int] = []
    freq: list[float] = []
    live = list(places)
    stop = min(end, len(index)) if end >= 0 else len(index)
    for d in range(limit):
        counts: dict[int, int] = {}
        first: dict[int, int] = {}
        alive = []
        for p in live:
            q = p + d
            if q >= stop:
                continue
            t = index.at(q)
            if t == SEP:
                continue
            alive.append(p)
            counts[t] = counts.get(t, 0) + 1
            first.setdefault(t, len(first))
        if not counts:
            break
        tok = max(counts, key=lambda t: (counts[t], -first[t]))  # ties: the most recent place
        out.append(tok)
        freq.append(counts[tok] / len(alive))
        live = [p for p in alive if index.at(p + d) == tok]
    return out, freq


class Store:
    """Finished documents (token lists), at most ``max_tokens`` tokens, the oldest dropped first."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.index = TokenIndex()
        self.starts: list[int] = []  # each kept document's first position

    def add(self, tokens: Sequence[int]) -> None:
        tokens = [int(t) for t in tokens][-self.max_tokens :] if self.max_tokens > 0 else []
        if not tokens:
            return
        self.starts.append(len(self.index))
        self.index.append(tokens)
        self.index.append([SEP])
        while len(self.index) - self.index.base > self.max_tokens + len(self.starts):
            self.starts.pop(0)
            self.index.drop_front(self.starts[0] if self.starts else len(self.index))

    @property
    def tokens(self) -> int:
        return len(self.index) - self.index.base - len(self.starts)


@dataclass
class Cells:
    """The acceptance estimates q per (source, match bucket, frequency bucket), learned online."""

    q: dict[tuple[str, int, int], float] = field(default_factory=dict)
    seen: dict[tuple[str, int, int], int] = field(default_factory=dict)

    @staticmethod
    def key(source: str, m: int, f: float) -> tuple[str, int, int]:
        return (source, min(max(m, 1), 4), 2 if f >= 0.99 else 1 if f >= 0.5 else 0)

    def estimate(self, key: tuple[str, int, int], f: float) -> float:
        if key in self.q:
            return self.q[key]
        return self.prior(key, f)

    def observe(self, key: tuple[str, int, int], accepted: bool, f: float) -> None:
        q = self.estimate(key, f)
        self.q[key] = q + EMA * (float(accepted) - q)
        self.seen[key] = self.seen.get(key, 0) + 1

    def untried(self, key: tuple[str, int, int], f: float) -> None:
        """The cell cut a draft (it is below the bound, so it is not observed): drift towards its
        prior, never past it."""
        q, prior = self.estimate(key, f), self.prior(key, f)
        if q < prior:
            self.q[key] = min(prior, q + UNTRIED * EMA * (prior - q))

    @staticmethod
    def prior(key: tuple[str, int, int], f: float) -> float:
        return PRIOR[key[1] - 1] * (1.0 if key[2] == 2 else f)


def survival_cut(q: Sequence[float], min_survival: float, lead: float = 1.0) -> tuple[int, float]:
    """How many tokens to keep (those whose survival ``lead`` * prod q stays >= ``min_survival``)
    and E, the expected number of them accepted; ``lead``: S_0."""
    s, e = lead, 0.0
    for j, qj in enumerate(q):
        s *= qj
        if s < min_survival:
            return j, e
        e += s
    return len(q), e


@dataclass
class Draft:
    """One proposal as the drafter made it, kept until the verifier's tokens settle it."""

    start: int  # position in the sequence (prompt included) of its first token
    tokens: list[int]
    keys: list[tuple[str, int, int]]
    freq: list[float]
    q: list[float]  # each token's q when proposed (the S_0 of a draft that extends it)
    source: str

    def drop_front(self, j: int) -> None:
        """Its first ``j`` tokens are settled: it now starts at the next one."""
        self.start += j
        self.tokens, self.keys, self.freq, self.q = self.tokens[j:], self.keys[j:], self.freq[j:], self.q[j:]


@dataclass
class DrafterCounts:
    """What one drafter did over a sequence (stage stats of a model-free stage 0)."""

    proposals: dict[str, int] = field(default_factory=dict)  # by source
    proposed: dict[str, int] = field(default_factory=dict)  # tokens, by source
    accepted: dict[str, int] = field(default_factory=dict)  # tokens settled as accepted, by source
    settled: dict[str, int] = field(default_factory=dict)  # tokens settled (accepted or first rejected)
    misses: int = 0  # calls with nothing to propose: no source matched the text's last token
    cut: int = 0  # calls where a source matched but its first token's survival was below the bound
    # (S_0 included: on top of unlikely unconfirmed drafts it waits for the verifier instead)
    forgotten: int = 0  # drafts made on a context that was rolled back, dropped unjudged

    def as_dict(self) -> dict:
        return {k: dict(v) if isinstance(v, dict) else v for k, v in self.__dict__.items()}


class SuffixDrafter:
    """A model-free stage 0 (``Proposer``): see the module docstring."""

    def __init__(
        self,
        name: str,
        max_proposal: int = 8,
        max_match: int = 16,
        min_survival: float = 0.1,
        max_candidates: int = 64,
        store_tokens: int = 200_000,
        corpus: Store | None = None,
        learned: dict[str, tuple[Store, Cells]] | None = None,
    ) -> None:
        self.name = name
        self.max_proposal = max_proposal
        self.max_match = max(1, min(max_match, MAX_MATCH_CAP))
        self.min_survival = min_survival
        self.max_candidates = max_candidates
        self.store_tokens = store_tokens
        # what the job has taught it, by key (the method): the finished outputs, the estimates
        self.learned = learned if learned is not None else {}
        self.store, self.cells = Store(0), Cells()
        self.corpus = corpus
        self.seq = TokenIndex()
        self.prompt_len = 0
        self.pending: list[Draft] = []
        self.missed = False  # the last call found nothing (and the sequence has not changed since)
        self.counts = DrafterCounts()

    def for_slot(self) -> SuffixDrafter:
        """Another sequence (a slot of batched decoding): its own sequence index; the job stores,
        the corpus and the acceptance estimates shared with this one."""
        return SuffixDrafter(
            self.name, self.max_proposal, self.max_match, self.min_survival, self.max_candidates,
            self.store_tokens, self.corpus, self.learned,
        )  # fmt: skip

    def learn(self, output: Sequence[int], store_key: str) -> None:
        """A finished output of the job that this stage did not draft for (it sat the prompt out:
        run/online.py) joins the job store ``store_key`` all the same."""
        if store_key not in self.learned:
            self.learned[store_key] = (Store(self.store_tokens), Cells())
        self.learned[store_key][0].add([int(t) for t in output])

    def prefill(self, prompt: Sequence[int], room: int = 0, store_key: str = "") -> None:
        """Start a sequence. ``store_key`` chooses the job store it drafts from and joins, and the
        estimates it learns: the stage loop passes the method, so that in a benchmark run, where
        every method decodes the same prompts, no method drafts from another's output of the
        same prompt."""
        if store_key not in self.learned:
            self.learned[store_key] = (Store(self.store_tokens), Cells())
        self.store, self.cells = self.learned[store_key]
        self.seq = TokenIndex()
        self.seq.append([int(t) for t in prompt])
        self.prompt_len = len(prompt)
        self.pending = []
        self.missed = False
        self.counts = DrafterCounts()

    def end_sequence(self, output: Sequence[int]) -> dict:
        """The sequence is over; ``output`` (its committed tokens, prompt excluded) joins the job
        store, drafts still unsettled are settled against it; returns what this drafter did
        (``DrafterCounts``) for the stage's stats."""
        full = self.seq.text[: self.prompt_len] + [int(t) for t in output]
        self._settle(full, len(full))
        self.store.add(output)
        return self.counts.as_dict()

    def propose(self, seq: Sequence[int], limit: int, confirmed: int | None = None) -> list[int]:
        """Up to ``limit`` tokens continuing ``seq`` (prompt + committed tokens), or [] when no
        source has a token worth proposing. ``confirmed``: how many leading tokens of ``seq``
        the verifier has committed (they settle earlier drafts); None: none known."""
        changed = self._sync(seq)
        if confirmed is not None:
            changed |= self._settle(seq, min(confirmed, len(seq)))
        limit = min(limit, self.max_proposal)
        if limit <= 0 or (not changed and self.missed):
            return []  # (a stage loop asks again while it waits: the answer has not changed)
        lead = self._lead(seq)
        best: tuple[float, Draft] | None = None  # (E, the draft)
        matched = False
        query = seq[-self.max_match :] if len(seq) > self.max_match else seq
        for source, index, own in self._sources():
            m, places = index.candidates(query, self.max_candidates, exclude=len(seq) if own else -1)
            if not places:
                continue
            matched = True
            toks, freq = continuation(index, places, len(seq) if own else -1, limit)
            keys = [Cells.key(source, m, f) for f in freq]
            q = [self.cells.estimate(k, f) for k, f in zip(keys, freq)]
            n, e = survival_cut(q, self.min_survival, lead)
            if n < len(q) and q[n] < self.min_survival:  # a cell below the bound cut it
                self.cells.untried(keys[n], freq[n])
            if n and (best is None or e > best[0]):
                best = (e, Draft(len(seq), toks[:n], keys[:n], freq[:n], q[:n], source))
        self.missed = best is None
        if best is None:
            if matched:
                self.counts.cut += 1
            else:
                self.counts.misses += 1
            return []
        draft = best[1]
        self.pending.append(draft)
        c = self.counts
        c.proposals[draft.source] = c.proposals.get(draft.source, 0) + 1
        c.proposed[draft.source] = c.proposed.get(draft.source, 0) + len(draft.tokens)
        return list(draft.tokens)

    def _sources(self):
        yield "sequence", self.seq, True
        if self.store.tokens:
            yield "job", self.store.index, False
        if self.corpus is not None and self.corpus.tokens:
            yield "corpus", self.corpus.index, False

    def _lead(self, seq: Sequence[int]) -> float:
        """S_0: the chance that the unconfirmed drafted tokens at the end of ``seq`` all survive
        (the pending drafts hold only unconfirmed tokens; a draft counts up to where ``seq`` no
        longer holds it: there the verifier's own token replaced it)."""
        s = 1.0
        for d in self.pending:
            for j, t in enumerate(d.tokens):
                if d.start + j >= len(seq) or seq[d.start + j] != t:
                    break
                s *= d.q[j]
        return s

    def _sync(self, seq: Sequence[int]) -> bool:
        """Make the sequence index hold ``seq``: cut back to the common prefix, append the rest;
        False when it held ``seq`` already. Drafts that started after the first changed position
        were made on a context that no longer stands: they are forgotten unjudged."""
        text = self.seq.text
        if text == list(seq):  # (lists of different lengths compare unequal at once)
            return False
        n = min(len(text), len(seq))
        if list(seq[:n]) != text[:n]:
            lo, hi = 0, n  # the longest common prefix: text[:lo] == seq[:lo], text[:hi] != seq[:hi]
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if list(seq[:mid]) == text[:mid]:
                    lo = mid
                else:
                    hi = mid
            n = lo
        if n < len(text):
            kept = [d for d in self.pending if d.start <= n]
            self.counts.forgotten += len(self.pending) - len(kept)
            self.pending = kept
        self.seq.truncate(n)
        self.seq.append([int(t) for t in seq[n:]])
        return True

    def _settle(self, seq: Sequence[int], confirmed: int) -> bool:
        """Learn from every draft whose tokens the verifier has now decided: token j is accepted
        when the committed token at its position equals it; the first rejected token ends it.
        True when a token was settled (S_0 changed)."""
        keep, any_settled = [], False
        for d in self.pending:
            j = 0
            while j < len(d.tokens) and d.start + j < confirmed:
                any_settled = True
                ok = seq[d.start + j] == d.tokens[j]
                self.cells.observe(d.keys[j], ok, d.freq[j])
                c = self.counts
                c.settled[d.source] = c.settled.get(d.source, 0) + 1
                if not ok:
                    break
                c.accepted[d.source] = c.accepted.get(d.source, 0) + 1
                j += 1
            if j < len(d.tokens) and d.start + j >= confirmed:
                d.drop_front(j)
                keep.append(d)
        self.pending = keep
        return any_settled


def read_corpus(path: str, encode, max_tokens: int) -> Store:
    """A user's text file as a store: paragraphs (blank-line separated) as documents."""
    text = Path(path).read_text(encoding="utf-8")
    store = Store(max_tokens)
    for para in text.split("\n\n"):
        if para.strip():
            store.add(encode(para))
    log.info("suffix corpus %s: %d tokens", path, store.tokens)
    return store
