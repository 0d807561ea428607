"""Online estimates of a stage's pipeline, and the goodput arithmetic its adaptive policy uses.

Notation (one stage, its upstream pair u -> s and its downstream pair s -> d):
  a_j      conditional acceptance of draft position j (1-based) of a verification at s: the
           chance that s accepts the j-th pending proposal given it accepted the j-1 before it
  E(k)     expected tokens s commits verifying k proposals: 1 + sum_{j<=k} prod_{i<=j} a_i (the
           1 is the correction or the bonus token, always committed); E(0) = 1 is an own step
  c(k)     seconds of a forward of s verifying k proposals (k + 1 rows); c(0) an own step
  g        seconds per proposal token arriving from u while s computes (its delivery rate)
  g_w      the same while s waits: on shared cores u then has more of them, so waiting can pay
           where the rate measured beside a forward says it cannot (docs/notebook.md,
           "Measurements behind the code's choices")
  q_d      the chance that a token s commits d tokens ahead of d's committed length is kept
           by d (not thrown away by a rollback): the drafter side's survival by distance

A verifier with p proposals pending verifies them all but a tail whose rows do not pay for
themselves (``verify_length``), and chooses the action of the highest rate (tokens per second):
  verify k now       E(k) / c(k)
  wait for m > p     E(m) / ((m - p) g_w + c(m))          (only while u can deliver)
  own step (p = 0)   (1 + E(m')) / (c(0) + c(m')),  m' = floor(c(0) / g) - 1
The own step is costed as a two-forward plan: u keeps drafting during it, so the step is followed
by a verification of what arrived meanwhile (less the position the step itself committed). Sunk
time never counts: the wait's rate uses max(g_w, seconds since the last arrival or the end of the
last forward, whichever came later), so a wait on a stalled upstream stops paying and the verifier
steps on its own. With ``decode.draft_survival`` set, a model drafter (any model stage but the
last) drafts position d ahead of its verifier only while q_d >= it: a token more likely thrown
away than kept costs compute (on shared cores, its neighbours') and delays its reaction to the
next rollback.

Every estimate is an exponential average (weight ``rate``) that starts from a prior: acceptance
``accept_prior`` (a position first observed starts from the one before it, one never observed
reads as the last observed, and one not judged by a verification drifts towards the acceptance of
all positions pooled, so that a position no longer tried is not judged by stale data); survival
1; costs unknown (all alike until forwards were timed, then measured per k and interpolated
between measured neighbours, so the paper's verify-everything holds until a verification was
timed); g unknown (then no waiting: PipeSpec's never-wait rule). The policy only orders a stage's
actions: what any stage commits is decided by its verifier alone, so no estimate, and no timing,
can change the output (greedy and Gumbel: the same tokens; Leviathan: the same distribution).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

MIN_COST_S = 1e-9  # a forward timed at zero (a coarse clock, the explorer's ticks) still costs
MAX_POSITIONS = 65  # draft positions / distances tracked (decode.max_verify and max_run_ahead <= 64)
OPTIMISM = 0.5  # g_w before any wait was measured, as a share of g (so that one wait is tried)


def expected_committed(accept: Sequence[float], k: int) -> float:
    """E(k): tokens committed by a verification of k proposals (correction or bonus included)."""
    total, survive = 1.0, 1.0
    for j in range(min(k, len(accept))):
        survive *= accept[j]
        total += survive
    return total


@dataclass(frozen=True)
class Choice:
    """A verifier's best action: ``verify`` k proposals now, ``wait`` for ``m`` pending, or ``own``."""

    act: str  # verify | wait | own
    n: int  # verify: k; wait: m; own: 0
    rate: float  # expected tokens per second


def choose(
    accept: Sequence[float],
    cost: Sequence[float],
    pending: int,
    limit: int,
    most_wait: int,
    gap_s: float | None,
    wait_gap_s: float | None = None,
) -> Choice:
    """The verifier's rate-maximising action (see the module's notation). ``cost[k]`` = c(k) for
    k in 0..limit; ``limit``: most proposals one verification may take; ``most_wait``: most
    proposals worth waiting for (0 when the upstream cannot deliver more); ``gap_s``: g (None:
    unknown, then the own step is costed alone); ``wait_gap_s``: g_w (None: g; both None: no
    waiting)."""
    if wait_gap_s is None:
        wait_gap_s = gap_s
    p = min(pending, limit)
    if p == 0:
        m1 = 0
        if gap_s is not None and gap_s > 0:
            m1 = max(0, min(limit, most_wait, int(cost[0] / gap_s) - 1))
        best = Choice("own", 0, (1.0 + expected_committed(accept, m1)) / (cost[0] + cost[m1]))
    else:
        k = verify_length(accept, cost, p)
        best = Choice("verify", k, expected_committed(accept, k) / cost[k])
    if wait_gap_s is not None and wait_gap_s < math.inf:
        for m in range(p + 1, min(limit, most_wait) + 1):
            r = expected_committed(accept, m) / ((m - p) * wait_gap_s + cost[m])
            if r > best.rate:
                best = Choice("wait", m, r)
    return best


def verify_length(accept: Sequence[float], cost: Sequence[float], pending: int) -> int:
    """How many of ``pending`` proposals to verify: all of them, less the tail positions whose row
    does not pay for itself, S_j c(0) < c(j) - c(j-1) with S_j = prod_{i<=j} a_i (the chance
    position j is committed, each committed token worth an own step). With flat costs (a
    memory-bound GPU) that is every pending proposal; where each row costs (a compute-bound CPU)
    the verification stops where survival falls below the row's share of a step. A proposal not
    verified now is not lost: the next verification takes it, so only the tail is cut."""
    survive = [1.0, *survivals(accept, pending)]
    k = pending
    while k > 1 and survive[k] * cost[0] < cost[k] - cost[k - 1]:
        k -= 1
    return k


def allot_rows(survivals: Sequence[Sequence[float]], budget: int, line: RowLine | None = None) -> list[int]:
    """A batched forward's row budget shared by its slots' verifications (TETRIS-style): every
    forward keeps its own row (the correction or bonus), and the remaining ``budget`` rows go to
    the (slot, position) pairs most likely to be committed, S_j = prod_{i<=j} a_i, a position only
    after the one before it, each only while it raises the forward's expected tokens per second
    by the stage's fitted costs (``line``: C = fixed + per_slot B + per_row e):
        S >= per_row K / C,  K = B + the survivals taken so far, C = the forward's cost so far
    (a row is worth its survival and costs per_row; it pays where that beats the forward's rate
    without it). The pairs come in falling S and K / C rises as long as rows pay, so the first
    that does not pay ends the allotment. No ``line`` (costs unknown) or a free row: every pair
    pays. ``survivals[i]``: S_1.. of slot i's proposal; returns how many of them each slot
    verifies (0: a step of its own this time, its proposals kept for later)."""
    extra = budget - len(survivals)
    ranked = sorted(
        ((s, j, i) for i, surv in enumerate(survivals) for j, s in enumerate(surv)),
        key=lambda x: (-x[0], x[1], x[2]),
    )
    priced = line is not None and line.per_row > 0.0
    tokens = float(len(survivals))
    seconds = line.fixed + line.per_slot * len(survivals) if priced else 0.0
    taken = [0] * len(survivals)
    for s, j, i in ranked:
        if extra <= 0 or (priced and s * seconds < line.per_row * tokens):
            break
        if j == taken[i]:  # the positions before it are taken: S falls with j, so mostly in order
            taken[i] += 1
            extra -= 1
            tokens += s
            if priced:
                seconds += line.per_row
    return taken


class RowLine(NamedTuple):
    """A batched forward's seconds, C(B, e) = fixed + per_slot B + per_row e, for B slots (each
    with its own row: a step's token, a verification's correction or bonus) and e verification
    rows beyond them."""

    fixed: float
    per_slot: float
    per_row: float


class RowCost:
    """A batched forward's seconds fitted as a ``RowLine`` by least squares over the forwards run,
    each weighted (1 - ``rate``) per forward since (so the line follows a node whose speed drifts).
    On CPUs a row is arithmetic, so a verification row is far from free (docs/notebook.md,
    "Measurements behind the code's choices"); on a memory-bound GPU a row is nearly free and
    every row pays.

    A slot and a verification row are fitted apart: where a slot costs more than a row (tiny
    models: a slot is a sequence's bookkeeping, a row nearly free), one line in all rows measured
    from steps alone (rows = slots) gives a verification row a slot's price, so no row pays and no
    verification runs to show otherwise (docs/notebook.md, "Measurements behind the code's
    choices"). The per-row cost is known only from forwards whose verification rows varied apart
    from their slots; until then, and again once a long run of forwards without verifications has
    faded them, ``line`` is None and every row pays, so the rows keep being measured."""

    def __init__(self, rate: float = 0.05) -> None:
        self.rate = rate
        # weighted sums of 1, B, e, C and their products
        self.w = self.b = self.e = self.c = self.bb = self.ee = self.be = self.bc = self.ec = 0.0

    def observe(self, slots: int, rows: int, seconds: float) -> None:
        """A forward of ``slots`` slots and ``rows`` rows in all took ``seconds``."""
        keep, e = 1.0 - self.rate, rows - slots
        self.w = keep * self.w + 1.0
        self.b = keep * self.b + slots
        self.e = keep * self.e + e
        self.c = keep * self.c + seconds
        self.bb = keep * self.bb + slots * slots
        self.ee = keep * self.ee + e * e
        self.be = keep * self.be + slots * e
        self.bc = keep * self.bc + slots * seconds
        self.ec = keep * self.ec + e * seconds

    def line(self) -> RowLine | None:
        """The fitted line, or None until verification rows varied enough, apart from the slots,
        to show what one costs."""
        if self.w < 2.0:
            return None
        w = self.w
        mb, me, mc = self.b / w, self.e / w, self.c / w
        vb, ve = self.bb / w - mb * mb, self.ee / w - me * me
        cbe, cbc, cec = self.be / w - mb * me, self.bc / w - mb * mc, self.ec / w - me * mc
        if vb < 0.25:  # (all but) every forward of the same slots: their cost is in the fixed part
            if ve < 0.25:
                return None
            per_slot, per_row = 0.0, cec / ve
        else:
            det = vb * ve - cbe * cbe
            if det < 0.25 * vb:  # e's variance not explained by B (det / vb) is under 0.25
                return None
            per_slot, per_row = (cbc * ve - cec * cbe) / det, (cec * vb - cbc * cbe) / det
        fixed = mc - per_slot * mb - per_row * me
        return RowLine(max(0.0, fixed), max(0.0, per_slot), per_row)


def survivals(accept: Sequence[float], n: int) -> list[float]:
    """S_1..S_n: the chance that each of n proposals is committed by a verification."""
    out, s = [], 1.0
    for j in range(n):
        s *= accept[j] if j < len(accept) else accept[-1]
        out.append(s)
    return out


def draft_reach(survival: Sequence[float], threshold: float, most: int) -> int:
    """How far ahead of its verifier a drafter drafts: every distance d (1-based) up to the first
    whose survival q_d is below ``threshold``, that one included (so the boundary keeps being
    measured), at most ``most``."""
    for d in range(1, most + 1):
        if d - 1 < len(survival) and survival[d - 1] < threshold:
            return d
    return most


class Estimates:
    """One stage's running estimates (see the notation above); kept across prompts."""

    def __init__(self, accept_prior: float, rate: float) -> None:
        self.rate = rate
        self.accept = [accept_prior] * MAX_POSITIONS
        self.pooled = accept_prior  # every judged position alike
        self.seen = 0  # draft positions observed at least once (1..seen); the later ones read as
        # the last observed (a verifier that cuts its verifications short must still value the
        # positions it no longer tries: acceptance rarely falls steeply with the position)
        self.survival = [1.0] * MAX_POSITIONS
        self.cost: dict[int, float] = {}  # k -> c(k), measured
        self.gap_s: float | None = None  # g: arrivals over a span in which this stage computed
        self.wait_gap_s: float | None = None  # g_w: over a span in which it only waited
        self.last_arrival: float | None = None
        self.computed = False  # a forward ran since the last arrival
        self.free_since: float | None = None  # the end of the last forward

    def _ema(self, old: float, new: float) -> float:
        return old + self.rate * (new - old)

    # ---------------------------------------------------------------- observations
    def verified(self, n: int, accepted: int) -> None:
        """A verification of n proposals accepted the first ``accepted``."""
        for j in range(min(n, MAX_POSITIONS)):
            if j >= self.seen:  # first observation: start from the position before it
                self.accept[j] = self.accept[j - 1] if j else self.accept[j]
                self.seen = j + 1
            ok = j < accepted
            self.accept[j] = self._ema(self.accept[j], float(ok))
            self.pooled = self._ema(self.pooled, float(ok))
            if not ok:  # position j rejected; the later ones were not judged
                break
        # positions not judged drift towards the pooled acceptance, at half the rate: an estimate
        # of a position that is no longer tried must not stay what it was when it was last tried
        for j in range(min(accepted + 1, n, self.seen), self.seen):
            self.accept[j] += 0.5 * self.rate * (self.pooled - self.accept[j])

    def forward(self, k: int, seconds: float, end: float | None = None) -> None:
        """A forward verifying k proposals (0: an own or draft step) took ``seconds``, ending at
        ``end`` on the stage's clock."""
        self.computed = True
        self.free_since = end
        seconds = max(seconds, MIN_COST_S)
        old = self.cost.get(k)
        self.cost[k] = seconds if old is None else self._ema(old, seconds)

    def arrived(self, now: float, n_tokens: int) -> None:
        """``n_tokens`` new proposal tokens were taken in at ``now``."""
        if n_tokens <= 0:
            return
        if self.last_arrival is not None:
            g = max(0.0, now - self.last_arrival) / n_tokens
            if self.computed:
                self.gap_s = g if self.gap_s is None else self._ema(self.gap_s, g)
            else:
                self.wait_gap_s = g if self.wait_gap_s is None else self._ema(self.wait_gap_s, g)
        self.last_arrival = now
        self.computed = False

    def restarted(self, now: float) -> None:
        """The upstream's proposals were dropped (a rollback): it starts again from ``now``."""
        self.last_arrival = now

    def fate(self, distance: int, kept: bool) -> None:
        """A token committed ``distance`` ahead of the verifier was kept, or thrown away."""
        if 1 <= distance <= MAX_POSITIONS:
            self.survival[distance - 1] = self._ema(self.survival[distance - 1], 1.0 if kept else 0.0)

    # ---------------------------------------------------------------- what decisions read
    def acceptance(self) -> list[float]:
        """a_1.. for decisions: observed positions as estimated, later ones as the last observed."""
        if self.seen == 0:
            return self.accept
        tail = self.accept[self.seen - 1]
        return self.accept[: self.seen] + [tail] * (MAX_POSITIONS - self.seen)

    def costs(self, limit: int) -> list[float]:
        """c(0..limit): measured buckets, others interpolated between measured neighbours (the
        nearest one outside the measured range); all equal to 1 before any forward was timed."""
        if not self.cost:
            return [1.0] * (limit + 1)
        known = sorted(self.cost)
        out = []
        for k in range(limit + 1):
            if k in self.cost:
                out.append(self.cost[k])
                continue
            lo = max((x for x in known if x < k), default=None)
            hi = min((x for x in known if x > k), default=None)
            if lo is None:
                out.append(self.cost[hi])
            elif hi is None:
                out.append(self.cost[lo])
            else:
                w = (k - lo) / (hi - lo)
                out.append(self.cost[lo] + w * (self.cost[hi] - self.cost[lo]))
        return out

    def snapshot(self, positions: int = 8) -> dict:
        """What a record keeps of the estimates at the end of a prompt: c(k) for the measured
        k, g, a_1.. and q_1.. of the first ``positions`` (rounded: for reading, not replaying)."""
        return {
            "cost_ms": {str(k): round(1000 * c, 3) for k, c in sorted(self.cost.items())},
            "gap_ms": None if self.gap_s is None else round(1000 * self.gap_s, 3),
            "wait_gap_ms": None if self.wait_gap_s is None else round(1000 * self.wait_gap_s, 3),
            "accept": [round(a, 3) for a in self.acceptance()[:positions]],
            "survival": [round(q, 3) for q in self.survival[:positions]],
        }

    def gap(self) -> float | None:
        """g (None until two arrivals were seen)."""
        return self.gap_s if self.gap_s is not None else self.wait_gap_s

    def expected_wait_gap(self) -> float | None:
        """g_w: ``OPTIMISM`` g until a wait was measured, at most g after (waiting never slows
        the upstream: a higher g_w is noise); None until any gap was measured."""
        if self.wait_gap_s is None:  # optimistic until a wait was measured: one wait measures it
            return None if self.gap_s is None else OPTIMISM * self.gap_s
        return self.wait_gap_s if self.gap_s is None else min(self.wait_gap_s, self.gap_s)

    def waited_an_own_step(self, now: float) -> bool:
        """The time since the end of the last forward is more than an own step costs (c(0) as
        measured; never before one was timed)."""
        deadline = self.answer_deadline()
        return deadline is not None and now > deadline

    def answer_deadline(self) -> float | None:
        """When ``waited_an_own_step`` turns true: an own step's cost after the end of the last
        forward (None before one was timed)."""
        c0 = self.cost.get(0)
        return None if c0 is None or self.free_since is None else self.free_since + c0

    def wait_gap(self, now: float) -> float | None:
        """g_w as seen now: a silence longer than the average counts, from the last arrival or
        the end of the last forward (sunk time does not)."""
        g = self.expected_wait_gap()
        if g is None:
            return None
        marks = [x for x in (self.last_arrival, self.free_since) if x is not None]
        since = now - max(marks) if marks else 0.0
        return max(g, since)
