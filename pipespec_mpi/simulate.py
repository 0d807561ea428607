"""Discrete-event simulator of AR, SD and PipeSpec over k stages (pure Python: no MPI, no torch).

What it models is what the real pipeline does (pipespec_mpi/spec/stage.py; the stage logic below
mirrors ``StageLoop`` method by method and reuses its bookkeeping, ``spec.sequence``):

  * every stage loops: read the downstream's header (adopt its tokens on a new rollback epoch or
    when it is ahead), take the proposals that have arrived, act, publish, send what is new;
  * stage 0 drafts one token per forward (a prompt-lookup stage proposes up to ``max_proposal``
    tokens at ~0 cost) at most ``max_run_ahead`` tokens beyond its downstream's committed length;
  * a verifier with enough pending proposals verifies min(pending, max_verify) of them in one
    forward and commits the accepted prefix plus one token of its own; with lookahead 0 and nothing
    pending it takes a one-token step of its own; a rejection bumps its epoch, the upstream rolls
    back to its tokens and proposals of the old epoch are dropped;
  * SD: each verifier waits for exactly ``lookahead`` proposals and the drafter only works when
    asked (the ``want`` field of the header); AR: the last stage alone.

Time: a forward over n tokens at context ctx takes ``LatencyProfile.forward_s(n, ctx)``; after each
action a stage spends ``overhead_s`` (publish, send, header read: the loop's own cost); a proposal
or a header change reaches the neighbour ``latency`` seconds after it is sent or published (the
transport plus the neighbour's polling delay). Stages prefill concurrently at time 0.

Tokens: every stage is a deterministic greedy "model" over real token values. A ``TokenOracle``
defines the target's greedy continuation of any prefix (a hash of the prefix) and, going down the
hierarchy, makes stage j agree with stage j+1 at a prefix with probability alpha_j (i.i.d. per
prefix), or, on the target's actual output path, as a recorded run's verifications say
(``Acceptance.traces``). Verification compares token values exactly as greedy verification does,
so rollbacks, discarded drafts and the lossless property (the output equals the target's own
greedy output) come out of the simulation rather than being assumed.

Commands (docs/simulator.md):
  python -m pipespec_mpi.simulate --preset paper [--json]
  python -m pipespec_mpi.simulate --from RUN_DIR [--json]
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import math
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from pipespec_mpi.spec.sequence import Inbox, adopt

METHODS = ("ar", "sd", "pipespec")
_M64 = (1 << 64) - 1


# ============================================================================ token oracle
def _mix(x: int) -> int:
    """splitmix64 finaliser: a fast, well-spread 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _unit(x: int) -> float:
    return (_mix(x) >> 11) * (1.0 / (1 << 53))


class TokenOracle:
    """Greedy continuations of every stage, as functions of the prefix (a 64-bit prefix hash).

    Pair j is (stage j -> stage j+1). The target (last stage) continues prefix h with
    ``T(h)``; stage j continues it with stage j+1's token if they agree at h, else with a token of
    its own (never equal to stage j+1's). Agreement at h is Bernoulli(rates[j]) drawn from the hash
    (so the same prefix always gives the same answer), except on the target's own output path at a
    position that ``traces[j]`` records, where the recorded verdict is used.
    """

    def __init__(
        self,
        rates: Sequence[float],
        traces: Sequence[Mapping[int, bool] | None] | None = None,
        seed: int = 0,
    ) -> None:
        for a in rates:
            if not 0.0 <= a <= 1.0:
                raise ValueError(f"acceptance rate {a}: must be in [0, 1]")
        self.rates = [float(a) for a in rates]
        self.k = len(self.rates) + 1
        traces = list(traces or [])
        self.traces = traces + [None] * (len(self.rates) - len(traces))
        self.root = _mix(0x5EED ^ (seed * 0x100000001B3))
        self._canon_h = [self.root]
        self._canon_tok: list[int] = []
        self._salt = [_mix(0xA11CE + 7919 * j) for j in range(self.k + 1)]

    @staticmethod
    def extend(h: int, tok: int) -> int:
        """Hash of the prefix ``h`` followed by ``tok``."""
        return _mix(h ^ ((tok * 0x9E3779B97F4A7C15) & _M64))

    def _target(self, h: int) -> int:
        return _mix(h ^ self._salt[self.k]) >> 3  # 61-bit token ids

    def _canonical_upto(self, pos: int) -> None:
        while len(self._canon_h) <= pos:
            h = self._canon_h[-1]
            tok = self._target(h)
            self._canon_tok.append(tok)
            self._canon_h.append(self.extend(h, tok))

    def canonical(self, n: int) -> list[int]:
        """The target's own greedy output (the AR answer), first ``n`` tokens."""
        self._canonical_upto(n)
        return self._canon_tok[:n]

    def on_path(self, h: int, pos: int) -> bool:
        """Whether prefix ``h`` of ``pos`` tokens is the target's own output so far."""
        self._canonical_upto(pos)
        return self._canon_h[pos] == h

    def agree(self, pair: int, h: int, pos: int) -> bool:
        tr = self.traces[pair]
        if tr is not None and pos in tr and self.on_path(h, pos):
            return tr[pos]
        return _unit(h ^ self._salt[pair]) < self.rates[pair]

    def token(self, stage: int, h: int, pos: int) -> int:
        """Stage ``stage``'s greedy token after prefix ``h`` (the prefix has ``pos`` tokens)."""
        tok = self._target(h)
        for j in range(self.k - 2, stage - 1, -1):
            if not self.agree(j, h, pos):
                own = (_mix(h ^ self._salt[j] ^ 0x0DD) >> 3) | (1 << 61)
                tok = own if own != tok else own ^ 1
        return tok


# ============================================================================ inputs
@dataclass(frozen=True)
class LatencyProfile:
    """Time of one stage's forward over n tokens at context length ctx (seconds).

    forward_s(n, ctx) = interp(points, n) + per_ctx_s * (ctx - ctx_ref), where ``points`` are
    (n, seconds) pairs, linearly interpolated and extrapolated with the last segment's slope (a
    single point means a flat profile). ``overhead_s`` is the loop's own cost after each action.
    kind="lookup" is a model-free drafter proposing up to ``max_proposal`` tokens per call, each
    call finding a continuation with probability ``lookup_hit_rate``, or ``lookup_chain_rate``
    (default: the same) when it continues its own previous proposal (copying from the same source,
    a real lookup usually finds the next n-gram too).
    """

    name: str = "stage"
    points: tuple[tuple[float, float], ...] = ((1.0, 0.01),)
    per_ctx_s: float = 0.0
    ctx_ref: float = 0.0
    overhead_s: float = 0.0
    prefill_base_s: float = 0.0
    prefill_per_token_s: float = 0.0
    kind: str = "model"
    max_proposal: int = 8
    lookup_hit_rate: float = 1.0
    lookup_chain_rate: float | None = None

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError(f"{self.name}: a latency profile needs at least one (n, s) point")
        pts = tuple(sorted((float(n), float(s)) for n, s in self.points))
        object.__setattr__(self, "points", pts)

    @classmethod
    def linear(cls, name: str, one_token_s: float, per_extra_token_s: float = 0.0, **kw) -> LatencyProfile:
        pts = ((1.0, one_token_s), (2.0, one_token_s + per_extra_token_s))
        return cls(name=name, points=pts, **kw)

    def forward_s(self, n: int, ctx: float = 0.0) -> float:
        pts = self.points
        if len(pts) == 1:
            t = pts[0][1]
        else:
            i = bisect.bisect_left([p[0] for p in pts], n)
            i = min(max(i, 1), len(pts) - 1)
            (n0, t0), (n1, t1) = pts[i - 1], pts[i]
            t = t0 + (t1 - t0) * (n - n0) / (n1 - n0)
        t += self.per_ctx_s * (ctx - self.ctx_ref)
        return max(t, 0.0)

    def prefill_s(self, n_prompt: int) -> float:
        return max(0.0, self.prefill_base_s + self.prefill_per_token_s * n_prompt)


@dataclass(frozen=True)
class Acceptance:
    """Acceptance between adjacent stages: per-pair i.i.d. rates, optionally recorded traces
    (per pair: output position -> did the drafter's token agree with the verifier's)."""

    rates: tuple[float, ...]
    traces: tuple[Mapping[int, bool] | None, ...] = ()
    # a lookup stage 0 on the target's output path: position -> proposal length (0: a miss),
    # as the run's lookup did there; other positions draw hits from ``lookup_hit_rate``
    lookup: Mapping[int, int] | None = None


@dataclass(frozen=True)
class SimConfig:
    method: str = "pipespec"
    lookahead: int = 0
    max_new_tokens: int = 128
    max_run_ahead: int = 16
    max_verify: int = 16
    prompt_len: int = 0
    # per adjacent pair (i, i+1): delay of proposals i -> i+1 and of i+1's header seen by i
    # (and of i's header seen by i+1); a float applies to every pair. up_latency_s, when given,
    # overrides the direction downstream -> upstream (headers: epochs, SD demand).
    latency_s: float | tuple[float, ...] = 0.0
    up_latency_s: float | tuple[float, ...] | None = None
    # header reads (rollback epochs, SD demand, idle flags) wait while the stage being read is
    # inside a forward: MPI passive-target RMA progresses only when the target calls into MPI
    # (MPICH without asynchronous progress, this project's transport). False: shared memory.
    blocking_reads: bool = False
    include_prefill: bool = True
    seed: int = 0
    record_timeline: bool = False
    max_events: int = 5_000_000

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r}: must be one of {METHODS}")
        if self.method == "sd" and self.lookahead < 1:
            raise ValueError("method=sd needs lookahead >= 1 (the fixed window)")
        if self.max_new_tokens < 1 or self.max_verify < 1 or self.max_run_ahead < 1:
            raise ValueError("max_new_tokens, max_verify and max_run_ahead must be >= 1")


# ============================================================================ outputs
@dataclass
class StageSim:
    """Per-stage counters, named as in the real run's StageStats."""

    stage: int
    model: str
    forward_calls: int = 0
    draft_steps: int = 0
    own_steps: int = 0
    verifications: int = 0
    tokens_proposed: int = 0
    tokens_verified: int = 0
    tokens_accepted: int = 0
    rollbacks: int = 0
    rollbacks_signalled: int = 0
    tokens_discarded: int = 0
    discarded_s: float = 0.0
    dropped_messages: int = 0
    busy_s: float = 0.0
    wait_s: float = 0.0
    blocked_s: float = 0.0  # stuck in a header read while the read stage computed
    prefill_s: float = 0.0
    tokens_generated: int = 0  # committed by this stage's own actions
    tokens_adopted: int = 0  # taken from the downstream's committed tokens
    final_tokens: int = 0
    verify_trace: list[list[int]] = field(default_factory=list)
    timeline: list[list] = field(default_factory=list)
    commit_times: list[list[float]] = field(default_factory=list)

    def token_balance(self) -> int:
        """generated + adopted - final - discarded: zero when no token is lost or double-counted."""
        return self.tokens_generated + self.tokens_adopted - self.final_tokens - self.tokens_discarded


@dataclass
class SimResult:
    method: str
    n_tokens: int
    wall_s: float
    tokens: list[int]
    reference: list[int]  # the target's own greedy output (what AR would produce)
    stages: list[StageSim]

    @property
    def ms_per_token(self) -> float:
        return 1000.0 * self.wall_s / self.n_tokens if self.n_tokens else float("nan")

    @property
    def lossless(self) -> bool:
        return self.tokens == self.reference[: len(self.tokens)]


# ============================================================================ the engine
@dataclass(frozen=True)
class _Header:
    epoch: int
    tokens: tuple[int, ...]
    done: bool
    want: int
    idle: bool

    @property
    def length(self) -> int:
        return len(self.tokens)


class _Blocked(Exception):
    """A header read has to wait until stage ``of`` leaves its forward at time ``until``."""

    def __init__(self, of: int, until: float) -> None:
        super().__init__(of, until)
        self.of, self.until = of, until


@dataclass(frozen=True)
class _Msg:
    t: float
    epoch: int
    start: int
    tokens: tuple[int, ...]


class _Stage:
    """One stage's state and actions; mirrors stage.StageLoop (same names where possible)."""

    def __init__(self, eng: _Engine, idx: int, prof: LatencyProfile) -> None:
        self.eng, self.i, self.prof = eng, idx, prof
        n = len(eng.profiles)
        self.upstream = idx - 1 if idx > 0 else None
        self.downstream = idx + 1 if idx < n - 1 else None
        self.is_last = self.downstream is None
        self.is_scorer = prof.kind != "lookup"
        self.stats = StageSim(idx, prof.name)
        self.out: list[int] = []
        self.hashes: list[int] = [eng.oracle.root]
        self.cost: list[float] = []
        self.epoch = self.seen_down_epoch = 0
        self.sent = 0
        self.want, self.idle = 0, False
        self.published = (0, False)
        self.down: _Header | None = None
        self.inbox = Inbox()
        self.headers: list[tuple[float, _Header]] = []  # (visible_from, header) per reader side
        self.inflight: list[_Msg] = []  # proposals travelling to this stage
        self.state = "init"  # busy | waiting | blocked | done
        self.next_run = 0.0
        self.forwards: list[tuple[float, float]] = []  # (start, end) of prefill and actions
        self.resumed_read: int | None = None  # the stage whose header read just unblocked
        self.blocked_t0 = 0.0
        self.wait_t0: float | None = None
        self.chain_end = -1  # a lookup stage's length after its last proposal (none adopted since)

    # ---------------------------------------------------------------- helpers
    @property
    def cfg(self) -> SimConfig:
        return self.eng.cfg

    def _ctx(self) -> int:
        return self.cfg.prompt_len + len(self.out)

    def _event(self, t0: float, t1: float, kind: str, n: int) -> None:
        if self.cfg.record_timeline:
            self.stats.timeline.append([t0, t1, kind, n, self._ctx()])

    def _publish(self, t: float, done: bool = False) -> None:
        h = _Header(self.epoch, tuple(self.out), done, self.want, self.idle)
        self.published = (self.want, self.idle)
        self.eng.publish(self.i, t, h)

    def _bump_epoch(self) -> None:
        self.inbox.clear()
        self.epoch += 1
        self.stats.rollbacks_signalled += 1

    @property
    def _capped(self) -> bool:
        return len(self.out) >= self.cfg.max_new_tokens

    def _set_out(self, tokens: list[int], keep: int) -> None:
        """Replace out by ``tokens`` whose first ``keep`` agree with the current ones."""
        oracle = self.eng.oracle
        del self.hashes[keep + 1 :]
        self.out = list(tokens)
        for tok in self.out[keep:]:
            self.hashes.append(oracle.extend(self.hashes[-1], tok))

    def _commit(self, tokens: list[int], cost_s: float, t_end: float) -> None:
        tokens = tokens[: self.cfg.max_new_tokens - len(self.out)]
        oracle = self.eng.oracle
        for tok in tokens:
            self.out.append(tok)
            self.hashes.append(oracle.extend(self.hashes[-1], tok))
        self.cost.extend([cost_s / max(1, len(tokens))] * len(tokens))
        self.stats.tokens_generated += len(tokens)
        if self.is_last:
            self.stats.commit_times.append([t_end, len(self.out)])

    def _greedy(self) -> int:
        return self.eng.oracle.token(self.i, self.hashes[-1], len(self.out))

    # ---------------------------------------------------------------- actions (return duration)
    def _step(self, t: float, kind: str) -> float:
        dur = self.prof.forward_s(1, self._ctx())
        n0 = len(self.out)
        self._commit([self._greedy()], dur, t + dur)
        self.stats.forward_calls += 1
        if kind == "draft":
            self.stats.draft_steps += 1
        else:
            self.stats.own_steps += 1
            if not self.inbox.advance(self.out, n0):
                self._bump_epoch()
        self._event(t, t + dur, kind, 1)
        return dur

    def _lookup(self, t: float, limit: int) -> float | None:
        # whether the n-gram recurs is a property of the context: a miss lasts until the context
        # changes (the downstream commits a token and this stage adopts it); on the target's
        # path, where the run's lookup was seen to hit or miss, it does the same
        oracle, h, toks = self.eng.oracle, self.hashes[-1], []
        seen = self.eng.lookup.get(len(self.out)) if self.eng.lookup else None
        if seen is not None and not oracle.on_path(h, len(self.out)):
            seen = None
        if seen is None:
            rate = self.prof.lookup_hit_rate
            if self.chain_end == len(self.out) and self.prof.lookup_chain_rate is not None:
                rate = self.prof.lookup_chain_rate
            if _unit(h ^ 0x100C0B) >= rate:
                return None
            seen = self.prof.max_proposal
        if seen <= 0:
            return None
        n = min(limit, seen)
        for q in range(n):
            tok = oracle.token(self.i, h, len(self.out) + q)
            toks.append(tok)
            h = oracle.extend(h, tok)
        dur = self.prof.forward_s(n, self._ctx())
        self.stats.draft_steps += 1
        self._commit(toks, dur, t + dur)
        self.chain_end = len(self.out)
        self._event(t, t + dur, "draft", n)
        return dur

    def _verify(self, t: float, n: int) -> float:
        proposal = self.inbox.tokens[:n]
        dur = self.prof.forward_s(n, self._ctx())
        oracle, h, pos = self.eng.oracle, self.hashes[-1], len(self.out)
        accepted = 0
        for tok in proposal:
            mine = oracle.token(self.i, h, pos + accepted)
            if tok != mine:
                nxt = mine
                break
            accepted += 1
            h = oracle.extend(h, tok)
        else:
            nxt = oracle.token(self.i, h, pos + accepted)
        n0 = len(self.out)
        self.stats.forward_calls += 1
        self.stats.verifications += 1
        self.stats.tokens_verified += n
        self.stats.tokens_accepted += accepted
        self.stats.verify_trace.append([n, accepted])
        self._commit([*proposal[:accepted], nxt], dur, t + dur)
        if accepted < n or not self.inbox.advance(self.out, n0):
            self._bump_epoch()
        self._event(t, t + dur, "verify", n)
        return dur

    # ---------------------------------------------------------------- synchronisation
    def _read(self, j: int, t: float) -> _Header:
        """Stage j's header as this stage reads it at time t (may raise _Blocked)."""
        if self.resumed_read == j:  # granted when j left its forward (plus the usual delay)
            self.resumed_read = None
            return self.eng.visible(j, self.i, t)
        if self.cfg.blocking_reads:
            end = self.eng.forward_end(j, t)
            if end is not None:
                # a read of the downstream is granted once it left its forward and published
                # (rollback epochs are seen without a stale draft in the measured runs); a read
                # of the upstream (its idle flag) returns at the end of its forward
                delay = self.eng.lat(j, self.i) if j == self.downstream else 0.0
                raise _Blocked(j, end + delay)
        return self.eng.visible(j, self.i, t)

    def _sync_downstream(self, t: float) -> bool:
        h = self._read(self.downstream, t)
        self.down = h
        if h.done:
            return True
        if h.epoch != self.seen_down_epoch or h.length > len(self.out):
            theirs = h.tokens
            epoch_changed = h.epoch != self.seen_down_epoch
            old = len(self.out)
            a = adopt(self.out, theirs)
            if a.discarded:
                self.stats.rollbacks += 1
                self.stats.tokens_discarded += a.discarded
                self.stats.discarded_s += sum(self.cost[a.keep :])
            self.stats.tokens_adopted += len(a.tokens) - a.keep
            self.cost = self.cost[: a.keep] + [0.0] * (len(a.tokens) - a.keep)
            self._set_out(a.tokens, a.keep)
            self.chain_end = -1
            if epoch_changed:
                self.seen_down_epoch = h.epoch
                self.sent = min(len(self.out), len(theirs))
            else:
                self.sent = max(self.sent, len(theirs)) if not a.discarded else len(theirs)
            if self.upstream is not None and (a.discarded or not self.inbox.advance(self.out, old)):
                self._bump_epoch()
            self._publish(t)
        return False

    def _poll_upstream(self, t: float) -> None:
        while self.inflight and self.inflight[0].t <= t:
            msg = self.inflight.pop(0)
            if msg.epoch != self.epoch:
                self.stats.dropped_messages += 1
                continue
            if not self.inbox.merge(self.out, msg.start, list(msg.tokens)):
                self._bump_epoch()
                self._publish(t)

    def _send_new(self, t: float) -> None:
        if self.downstream is None or self.sent >= len(self.out):
            return
        toks = tuple(self.out[self.sent :])
        self.eng.send(self.i, t, self.seen_down_epoch, self.sent, toks)
        self.stats.tokens_proposed += len(toks)
        self.sent = len(self.out)

    # ---------------------------------------------------------------- policy (as StageLoop._act)
    def _room(self, method: str) -> int:
        room = self.cfg.max_new_tokens - len(self.out)
        if self.is_last:
            return room
        down_len = self.down.length if self.down else 0
        if method == "sd":
            want = self.down.want if self.down else 0
            return min(room, max(0, want - len(self.out)))
        return min(room, self.cfg.max_run_ahead - (len(self.out) - down_len))

    def _upstream_idle(self, t: float) -> bool:
        return self._read(self.upstream, t).idle

    def _act(self, t: float, method: str) -> float | None:
        cfg = self.cfg
        if self._capped:
            self.idle = True
            return None
        room = self._room(method)
        if room <= 0:
            self.idle = False
            return None
        if method == "ar":
            return self._step(t, "own")
        if self.upstream is None:
            if self.is_scorer:
                return self._step(t, "draft")
            dur = self._lookup(t, room)
            self.idle = dur is None
            return dur
        # n verified commit up to n + 1: the last stage keeps that within max_new_tokens; the
        # others may overshoot their bound or demand by the bonus token
        budget = room if self.is_last else cfg.max_new_tokens - len(self.out)
        limit = min(cfg.max_verify, budget - 1)
        pending = len(self.inbox.tokens)
        if method == "sd":
            window = min(cfg.lookahead, limit)
            self.want = len(self.out) + window
            if window == 0:
                return self._step(t, "own")
            if pending >= window:
                return self._verify(t, window)
        else:
            need = max(1, min(cfg.lookahead, limit))
            if pending >= need and limit >= 1:
                return self._verify(t, min(pending, limit))
            if cfg.lookahead == 0:
                return self._step(t, "own")
        if self._upstream_idle(t):
            if pending and limit >= 1:
                return self._verify(t, min(pending, limit))
            return self._step(t, "own")
        return None

    # ---------------------------------------------------------------- one loop iteration
    def iterate(self, t: float) -> None:
        if self.state == "blocked" and self.wait_t0 is None:
            self.stats.blocked_s += t - self.blocked_t0
        try:
            self._iterate(t)
        except _Blocked as b:
            self.blocked_t0 = t
            self.state = "blocked"
            self.resumed_read = b.of
            self.next_run = b.until
            self.eng.schedule(b.until, self.i)
        else:
            self.resumed_read = None

    def _iterate(self, t: float) -> None:
        method = self.cfg.method
        if self.downstream is not None and self._sync_downstream(t):
            self._finish(t)
            return
        if self.upstream is not None and method != "ar":
            self._poll_upstream(t)
        if self.is_last and self._capped:
            self._finish(t)
            return
        dur = self._act(t, method)
        if dur is not None:
            if self.wait_t0 is not None:
                self.stats.wait_s += t - self.wait_t0
                if self.cfg.record_timeline:
                    self.stats.timeline.append([self.wait_t0, t, "wait", 0, self._ctx()])
                self.wait_t0 = None
            t_end = t + dur
            self.forwards.append((t, t_end))
            self.stats.busy_s += dur
            self._publish(t_end)
            self._send_new(t_end)
            self.state = "busy"
            self.next_run = t_end + self.prof.overhead_s
            self.eng.schedule(self.next_run, self.i)
            return
        if self.published != (self.want, self.idle):
            self._publish(t)
        if self.wait_t0 is None:
            self.wait_t0 = t
        self.state = "waiting"

    def _finish(self, t: float) -> None:
        self.state = "done"
        self._publish(t, done=True)
        if self.is_last:
            self.eng.end_t = t


class _Engine:
    def __init__(
        self,
        profiles: Sequence[LatencyProfile],
        acceptance: Acceptance,
        cfg: SimConfig,
    ) -> None:
        k = len(profiles)
        if k < 1:
            raise ValueError("need at least one stage")
        if len(acceptance.rates) != k - 1:
            raise ValueError(f"{k} stages need {k - 1} acceptance rates, got {acceptance.rates}")
        if profiles[-1].kind == "lookup":
            raise ValueError("the last stage must be a model")
        if any(p.kind == "lookup" for p in profiles[1:]):
            raise ValueError("a lookup stage can only be stage 0")
        if cfg.method != "ar" and k < 2:
            raise ValueError(f"method={cfg.method} needs at least two stages")
        self.profiles, self.cfg = list(profiles), cfg
        self.oracle = TokenOracle(acceptance.rates, acceptance.traces, seed=cfg.seed)
        self.lookup = acceptance.lookup
        self.down_lat = self._per_pair(cfg.latency_s, k)
        up = cfg.up_latency_s if cfg.up_latency_s is not None else cfg.latency_s
        self.up_lat = self._per_pair(up, k)
        self.heap: list[tuple[float, int, int]] = []
        self.seq = 0
        self.end_t: float | None = None
        self.stages = [_Stage(self, i, p) for i, p in enumerate(profiles)]
        # the fresh header every stage publishes before the start barrier (StageLoop.reset)
        for s in self.stages:
            s.headers.append((-math.inf, _Header(0, (), False, 0, False)))

    @staticmethod
    def _per_pair(v: float | Sequence[float], k: int) -> list[float]:
        if isinstance(v, (int, float)):
            return [float(v)] * max(k - 1, 0)
        v = [float(x) for x in v]
        if len(v) != k - 1:
            raise ValueError(f"{k} stages need {k - 1} per-pair latencies, got {v}")
        return v

    def lat(self, frm: int, to: int) -> float:
        """Delay of anything stage ``frm`` publishes or sends, as seen by neighbour ``to``."""
        return self.down_lat[frm] if to > frm else self.up_lat[to]

    def schedule(self, t: float, stage: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, stage))

    def publish(self, i: int, t: float, h: _Header) -> None:
        self.stages[i].headers.append((t, h))
        for j in (i - 1, i + 1):
            if 0 <= j < len(self.stages):
                self.schedule(t + self.lat(i, j), j)

    def visible(self, i: int, reader: int, t: float) -> _Header:
        """Stage i's latest header as stage ``reader`` sees it at time t."""
        lat = self.lat(i, reader)
        hs = self.stages[i].headers
        for tp, h in reversed(hs):
            if tp + lat <= t:
                return h
        return hs[0][1]

    def forward_end(self, i: int, t: float) -> float | None:
        """End of stage i's forward in progress at time t, if any."""
        fw = self.stages[i].forwards
        k = bisect.bisect_right(fw, (t, math.inf)) - 1
        if k >= 0 and fw[k][0] <= t < fw[k][1]:
            return fw[k][1]
        return None

    def send(self, i: int, t: float, epoch: int, start: int, toks: tuple[int, ...]) -> None:
        t_arr = t + self.lat(i, i + 1)
        self.stages[i + 1].inflight.append(_Msg(t_arr, epoch, start, toks))
        self.schedule(t_arr, i + 1)

    def run(self) -> SimResult:
        cfg = self.cfg
        k = len(self.stages)
        active = [k - 1] if cfg.method == "ar" else list(range(k))
        for i in active:
            s = self.stages[i]
            pre = s.prof.prefill_s(cfg.prompt_len) if cfg.include_prefill else 0.0
            s.stats.prefill_s = pre
            if cfg.record_timeline:
                s.stats.timeline.append([0.0, pre, "prefill", cfg.prompt_len, cfg.prompt_len])
            s.state = "busy"
            s.next_run = pre
            if pre > 0:
                s.forwards.append((0.0, pre))
            self.schedule(pre, i)
        events = 0
        while self.heap and self.end_t is None:
            t, _, i = heapq.heappop(self.heap)
            s = self.stages[i]
            if i not in active or s.state == "done":
                continue
            if s.state in ("busy", "blocked") and t < s.next_run:
                continue  # a wake-up while computing: the stage's next iteration sees it anyway
            s.iterate(t)
            events += 1
            if events > cfg.max_events:
                raise RuntimeError(f"simulation exceeded {cfg.max_events} events")
        if self.end_t is None:
            state = {s.i: (s.state, len(s.out), len(s.inbox.tokens)) for s in self.stages}
            raise RuntimeError(f"simulation stalled before the last stage finished: {state}")
        last = self.stages[-1]
        for s in self.stages:
            s.stats.final_tokens = len(s.out)
        n = len(last.out)
        return SimResult(
            method=cfg.method,
            n_tokens=n,
            wall_s=self.end_t,
            tokens=list(last.out),
            reference=self.oracle.canonical(n),
            stages=[s.stats for s in self.stages],
        )


def simulate(
    profiles: Sequence[LatencyProfile],
    acceptance: Acceptance | Sequence[float],
    cfg: SimConfig,
) -> SimResult:
    """Simulate one prompt: ``profiles`` per stage (last = target), acceptance per adjacent pair."""
    if not isinstance(acceptance, Acceptance):
        acceptance = Acceptance(tuple(float(a) for a in acceptance))
    return _Engine(profiles, acceptance, cfg).run()


def mean_ms_per_token(
    profiles: Sequence[LatencyProfile],
    acceptance: Acceptance | Sequence[float],
    cfg: SimConfig,
    seeds: Sequence[int] = (0, 1, 2, 3),
) -> float:
    """Aggregate ms/token (total time over total tokens) over several seeds."""
    rs = [simulate(profiles, acceptance, replace(cfg, seed=s)) for s in seeds]
    return 1000.0 * sum(r.wall_s for r in rs) / sum(r.n_tokens for r in rs)


# ============================================================================ calibration
# A run directory holds results.jsonl: one record per (prompt, method), each with per-stage
# timelines ([t0, t1, kind, n_tokens, context_len], kind in prefill/draft/verify/own/wait; the
# context is the one after the action's commit) and verify traces ([n_proposed, n_accepted]).
# Note: a "wait" event is closed after the action that ends it, so its t1 overlaps that action;
# only its start is used here, and a wait is taken to end where the next action starts.
_ACTIONS = ("draft", "verify", "own")


def load_records(run_dir: str | Path) -> list[dict]:
    """The run's non-warm-up records, in file order."""
    path = Path(run_dir) / "results.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no results.jsonl (is {run_dir} a run directory?)")
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            if not r.get("warmup"):
                out.append(r)
    return out


def _events(stage_rec: dict) -> list[list]:
    return sorted(stage_rec.get("timeline") or [], key=lambda e: (e[0], e[1]))


def _offsets(rec: dict) -> list[float] | None:
    """Per stage: its timeline's start on the last stage's clock, from the records' absolute
    ``t0_perf_counter`` (one clock for the processes of a node); None when a stage lacks it."""
    t0 = [sr.get("t0_perf_counter") for sr in rec["stages"]]
    if any(not isinstance(t, (int, float)) or t <= 0 for t in t0):
        return None
    return [float(t) - float(t0[-1]) for t in t0]


def _stage_events(rec: dict, stage: int) -> list[list]:
    """A stage's timeline on the common clock (as recorded when the run has no common clock)."""
    ev = _events(rec["stages"][stage])
    off = _offsets(rec)
    if not off or off[stage] == 0.0:
        return ev
    d = off[stage]
    return [[e[0] + d, e[1] + d, *e[2:]] for e in ev]


def _lsq_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0


def fit_profile(stage_recs: Sequence[dict], name: str, kind: str = "model") -> LatencyProfile:
    """A stage's latency profile from its timeline events across records.

    forward time: mean per number of tokens n, plus a context slope fitted within each n
    (pooled); overhead: mean gap between the end of an action and the stage's next decision
    (the next action or the start of a wait); prefill: linear in the prompt length.
    """
    by_n: dict[int, list[tuple[float, float]]] = {}
    gaps: list[float] = []  # action -> action: the loop's cost between back-to-back actions
    idle_gaps: list[float] = []  # action -> start of a wait (used only when no gap is seen)
    pre: list[tuple[float, float]] = []
    for sr in stage_recs:
        ev = _events(sr)
        for e in ev:
            if e[2] in _ACTIONS:
                by_n.setdefault(int(e[3]), []).append((float(e[4]), e[1] - e[0]))
            elif e[2] == "prefill":
                pre.append((float(e[3]), e[1] - e[0]))
        for a, b in zip(ev, ev[1:]):
            if a[2] in _ACTIONS and b[2] in _ACTIONS:
                gaps.append(max(0.0, b[0] - a[1]))
            elif a[2] in _ACTIONS and b[2] == "wait":
                idle_gaps.append(max(0.0, b[0] - a[1]))
    if not by_n:
        raise ValueError(f"stage {name}: no forward events to fit a latency profile from")
    # context slope, pooled within groups of equal n
    dx, dy = [], []
    for obs in by_n.values():
        mc = sum(c for c, _ in obs) / len(obs)
        md = sum(d for _, d in obs) / len(obs)
        dx += [c - mc for c, _ in obs]
        dy += [d - md for _, d in obs]
    slope = max(0.0, _lsq_slope(dx, dy)) if len(dx) > 2 else 0.0
    all_ctx = [c for obs in by_n.values() for c, _ in obs]
    ctx_ref = sum(all_ctx) / len(all_ctx)
    points = []
    for n, obs in sorted(by_n.items()):
        mc = sum(c for c, _ in obs) / len(obs)
        md = sum(d for _, d in obs) / len(obs)
        points.append((float(n), max(1e-7, md - slope * (mc - ctx_ref))))
    if pre:
        ps = _lsq_slope([n for n, _ in pre], [d for _, d in pre])
        ps = max(0.0, ps)
        base = sum(d for _, d in pre) / len(pre) - ps * sum(n for n, _ in pre) / len(pre)
        if base < 0:
            base, ps = 0.0, sum(d for _, d in pre) / max(1.0, sum(n for n, _ in pre))
    else:
        base, ps = 0.0, 0.0
    return LatencyProfile(
        name=name,
        points=tuple(points),
        per_ctx_s=slope,
        ctx_ref=ctx_ref,
        overhead_s=statistics.fmean(gaps or idle_gaps or [0.0]),
        prefill_base_s=base,
        prefill_per_token_s=ps,
        kind=kind,
    )


def _forwards(rec: dict, stage: int) -> list[tuple[float, float]]:
    return [(e[0], e[1]) for e in _stage_events(rec, stage) if e[2] in _ACTIONS or e[2] == "prefill"]


def overhead_samples(rec: dict, stage: int, blocking_reads: bool = False) -> tuple[list[float], list[float]]:
    """The loop's own cost after an action of a stage (publish, send, the next header read and
    decision), as (gaps to a next action, gaps to the start of a wait). With ``blocking_reads``
    (runs made with the old MPI RMA window, whose header read of a computing stage waited for its
    forward; the simulator models that wait separately) each gap is less the time a neighbour it
    reads spent in a forward meanwhile: every iteration reads the downstream; a stage that finds
    nothing to do also reads its upstream's idle flag before it starts waiting."""
    st = rec["stages"]
    down: list[tuple[float, float]] = []
    both: list[tuple[float, float]] = []
    if blocking_reads:
        down = _union(_forwards(rec, stage + 1)) if stage + 1 < len(st) else []
        both = _union(down + (_forwards(rec, stage - 1) if stage > 0 else []))
    ev = [e for e in _stage_events(rec, stage) if e[2] in _ACTIONS or e[2] == "wait"]
    to_act: list[float] = []
    to_wait: list[float] = []
    for a, b in zip(ev, ev[1:]):
        if a[2] in _ACTIONS:
            t0, t1 = a[1], b[0]
            acting = b[2] in _ACTIONS
            busy = down if acting else both
            overlap = sum(max(0.0, min(t1, e1) - max(t0, e0)) for e0, e1 in busy)
            (to_act if acting else to_wait).append(max(0.0, t1 - t0 - overlap))
    return to_act, to_wait


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _committed_series(rec: dict, stage: int) -> list[tuple[float, int]]:
    """(action end, committed length after it) for a stage, in time order."""
    p = len(rec.get("prompt_ids") or [])
    return [(e[1], int(e[4]) - p) for e in _stage_events(rec, stage) if e[2] in _ACTIONS]


def _verify_bases(rec: dict, stage: int) -> list[tuple[list, int, int]]:
    """(event, base position, n_accepted) for each verification of a stage, in order."""
    p = len(rec.get("prompt_ids") or [])
    cap = int(rec.get("n_new_tokens") or rec.get("max_new_tokens") or 10**9)
    sr = rec["stages"][stage]
    ver = [e for e in (sr.get("timeline") or []) if e[2] == "verify"]  # recording order
    out = []
    for e, (_n, a) in zip(ver, sr.get("verify_trace") or []):
        after = int(e[4]) - p
        committed = int(a) + 1
        if after >= cap:  # the commit may have been cut at the cap
            committed = min(committed, after)
        out.append((e, max(0, after - committed), int(a)))
    return out


def agreement_trace(rec: dict, stage: int) -> dict[int, bool]:
    """Pair (stage-1 -> stage): output position -> whether the drafter's token agreed with the
    verifier's, from the verifier's verifications (later verifications win)."""
    agree: dict[int, bool] = {}
    for e, b, a in _verify_bases(rec, stage):
        n = int(e[3])
        for q in range(a):
            agree[b + q] = True
        if a < n:
            agree[b + a] = False
    return agree


def lookup_trace(rec: dict) -> dict[int, int]:
    """A lookup stage 0's hits and misses by position: base position -> the longest proposal it
    drafted from there, or 0 where the next stage took a step of its own from there (its
    upstream was idle: the lookup found no continuation) and the lookup never drafted from it."""
    st = rec["stages"]
    if len(st) < 2:
        return {}
    p = len(rec.get("prompt_ids") or [])
    seen: dict[int, int] = {}
    for e in _events(st[0]):
        if e[2] == "draft":
            b = int(e[4]) - p - int(e[3])
            seen[b] = max(seen.get(b, 0), int(e[3]))
    for e in _events(st[1]):
        if e[2] == "own":
            seen.setdefault(int(e[4]) - p - 1, 0)
    return seen


def _lookup_chain_rate(recs: Sequence[dict]) -> float | None:
    """How often a lookup stage 0 that had room after a proposal found a continuation of it (its
    next draft starts where the proposal ended, before it adopted anything); None without a
    common clock (the room depends on the downstream's length at that moment)."""
    chained = tried = 0
    for rec in recs:
        if _offsets(rec) is None or len(rec["stages"]) < 2 or rec.get("method") != "pipespec":
            return None  # (SD: the drafter proposes only what the verifier asks for)
        p = len(rec.get("prompt_ids") or [])
        cap = int(rec.get("n_new_tokens") or 0)
        bound = int(rec.get("max_run_ahead") or 16)
        down = _committed_series(rec, 1)
        down_t = [t for t, _ in down]
        dr = [e for e in _stage_events(rec, 0) if e[2] == "draft"]
        for k, a in enumerate(dr):
            end = int(a[4]) - p
            i = bisect.bisect_right(down_t, a[1]) - 1
            down_len = down[i][1] if i >= 0 else 0
            if end >= cap or end - down_len >= bound:
                continue  # no room: the stage waits, it does not look up
            nxt = dr[k + 1] if k + 1 < len(dr) else None
            j = bisect.bisect_right(down_t, nxt[0]) - 1 if nxt else -1
            if nxt is not None and j != i:
                continue  # the downstream acted in between: the next lookup may follow an adoption
            tried += 1
            chained += nxt is not None and int(nxt[4]) - p - int(nxt[3]) == end
    return chained / tried if tried else None


def _crossing(series: list[tuple[float, int]], length: int, before: float) -> float | None:
    """End time of the upstream action after which its committed length last rose to
    >= ``length`` (among actions ending before ``before``)."""
    idx = bisect.bisect_right([t for t, _ in series], before) - 1
    if idx < 0 or series[idx][1] < length:
        return None
    while idx > 0 and series[idx - 1][1] >= length:
        idx -= 1
    return series[idx][0]


_CLOCK_SLACK_S = 0.01  # the most two ranks' barrier exits are assumed apart (records without a clock)


def latency_samples(rec: dict, pair: int, offset_s: float = 0.0) -> tuple[list[float], list[float]]:
    """Delays observed across pair (pair -> pair+1) in one record, as (down, up), each measured
    on two ranks' clocks: the common one when the records carry ``t0_perf_counter``, else each
    rank's own, stage pair+1's shifted by ``offset_s`` (see ``calibrate``).

    down (proposals): a verifier that waited starts verifying; the delay is measured from the
    end of the upstream action that completed the proposals it waited for: the upstream's last
    action before the verification, if it ended during the wait (proposals sent before the wait
    were of an older epoch, or not enough).
    up (headers), only where the upstream is the first stage: after each verification or own
    step of the downstream, the delay to the drafter's first draft that continues the
    downstream's new tokens (a draft starting at the downstream's committed length).
    """
    down: list[float] = []
    up: list[float] = []
    look = int(rec.get("lookahead") or 0)
    method = rec.get("method")
    p = len(rec.get("prompt_ids") or [])
    ups = _committed_series(rec, pair)
    up_ends = [t for t, _ in ups]
    bases = _verify_bases(rec, pair + 1)
    starts = {id(e): b for e, b, _ in bases}
    off = _offsets(rec)
    dv = off[pair + 1] if off else offset_s
    ev = _events(rec["stages"][pair + 1])
    for w, v in zip(ev, ev[1:]):
        if w[2] != "wait" or v[2] != "verify" or id(v) not in starts:
            continue
        # without a common clock the triggering action may seem to end after the verification
        # started: take the upstream action ending nearest to it (the sample may be negative)
        i = bisect.bisect_right(up_ends, v[0] + dv + (0.0 if off else _CLOCK_SLACK_S)) - 1
        if i >= 0 and up_ends[i] >= w[0] + dv:
            if (
                i + 1 < len(up_ends)
                and not off
                and abs(up_ends[i + 1] - v[0] - dv) < abs(up_ends[i] - v[0] - dv)
            ):
                i += 1
            down.append(v[0] + dv - up_ends[i])
    if pair != 0:
        return down, up
    drafts = [e for e in _stage_events(rec, 0) if e[2] in _ACTIONS]
    d0 = [d[0] for d in drafts]
    acts = [[e[0] + dv, e[1] + dv, *e[2:]] for e in ev if e[2] in ("verify", "own")]
    # SD with a stage after the verifier: the verifier asks for more only while its own
    # downstream still wants tokens; otherwise the drafter waits for that stage, not for a header
    demand = _committed_series(rec, 2) if method == "sd" and len(rec["stages"]) > 2 else None
    for k, v in enumerate(acts):
        length = int(v[4]) - p
        if demand is not None:
            i = bisect.bisect_right([t for t, _ in demand], v[1]) - 1
            if length >= (demand[i][1] if i >= 0 else 0) + look:
                continue
        hi = acts[k + 1][0] if k + 1 < len(acts) else math.inf
        for d in drafts[bisect.bisect_left(d0, v[0]) :]:
            if d[0] > hi:
                break
            if int(d[4]) - p - int(d[3]) == length:  # the draft continues from the new tokens
                up.append(d[0] - v[1])
                break
    return down, up


def _quantile(xs: Sequence[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(q * (len(xs) - 1))))]


@dataclass(frozen=True)
class Calibration:
    """Simulator inputs fitted from records of one method."""

    method: str
    profiles: tuple[LatencyProfile, ...]
    rates: tuple[float, ...]
    down_latency_s: tuple[float, ...]
    up_latency_s: tuple[float, ...]


def _pooled_rate(recs: Sequence[dict], stage: int) -> float:
    from pipespec_mpi.analytical import alpha_from_trace

    trace = [t for r in recs for t in (r["stages"][stage].get("verify_trace") or [])]
    return alpha_from_trace(trace)


def calibrate(recs: Sequence[dict], blocking_reads: bool = False) -> Calibration:
    """Fit profiles, per-pair acceptance and latencies from records of one method
    (``blocking_reads``: the records come from a pipeline whose header reads blocked)."""
    if not recs:
        raise ValueError("no records to calibrate from")
    method = recs[0]["method"]
    k = len(recs[0]["stages"])
    names = list(recs[0].get("models") or [f"stage{i}" for i in range(k)])
    profiles = []
    for i in range(k):
        srs = [r["stages"][i] for r in recs]
        if method == "ar" and i < k - 1:
            profiles.append(LatencyProfile(name=names[i]))  # idle in AR
            continue
        kind = "model"
        if i == 0 and all((s.get("forward_calls", 1) == 0 and s.get("draft_steps", 0) > 0) for s in srs):
            kind = "lookup"
        try:
            prof = fit_profile(srs, names[i], kind)
        except ValueError:  # the stage never ran a forward (e.g. a lookup that never hit)
            profiles.append(
                LatencyProfile(name=names[i], points=((1.0, 1e-6),), kind=kind, lookup_hit_rate=0.0)
            )
            continue
        if kind == "lookup":
            # misses leave no event; each makes the verifier take a step of its own (its upstream
            # is idle), so hits / (hits + those steps) estimates how often a context recurs
            hits = sum(s.get("draft_steps", 0) for s in srs)
            own = sum(r["stages"][1].get("own_steps", 0) for r in recs)
            longest = max(int(n) for n, _ in prof.points)
            prof = replace(prof, lookup_hit_rate=hits / (hits + own) if hits + own else 1.0,
                           max_proposal=longest, lookup_chain_rate=_lookup_chain_rate(recs))  # fmt: skip
        samples = [overhead_samples(r, i, blocking_reads) for r in recs]
        to_act = [x for a, _ in samples for x in a]
        to_wait = [x for _, w in samples for x in w]
        # a stage that often acts back to back (a drafter) pays the loop's cost between actions;
        # one that waits after each action (a verifier) publishes its new demand only after it
        ov = to_act if len(to_act) >= 10 or not to_wait else to_wait
        if ov:
            prof = replace(prof, overhead_s=statistics.fmean(ov))
        profiles.append(prof)
    rates, downs, ups = [], [], []
    for j in range(k - 1):
        rates.append(_pooled_rate(recs, j + 1) if method != "ar" else 0.0)
        d_s: list[float] = []
        u_s: list[float] = []
        for r in recs if method != "ar" else []:
            d, u = latency_samples(r, j)
            if d and _offsets(r) is None:
                # no common clock (older records): each rank's timeline starts at its own exit
                # from the start barrier. Take the fastest deliveries as equal in both directions
                # (NTP-like), or as immediate where only proposals are seen, and measure again
                # with that offset (which proposals count as awaited depends on it)
                skew = (_quantile(u, 0.05) - _quantile(d, 0.05)) / 2 if u else -_quantile(d, 0.05)
                d, u = latency_samples(r, j, skew)
            d_s += d
            u_s += u
        down = max(0.0, statistics.median(d_s)) if d_s else None
        up = max(0.0, statistics.median(u_s)) if u_s else None
        downs.append(down if down is not None else (up if up is not None else 0.0))
        ups.append(up if up is not None else downs[-1])
    return Calibration(method, tuple(profiles), tuple(rates), tuple(downs), tuple(ups))


def simulate_record(
    rec: dict,
    cal: Calibration,
    use_traces: bool = True,
    max_run_ahead: int = 16,
    max_verify: int = 16,
    seed: int = 0,
    blocking_reads: bool = False,
) -> SimResult:
    """Re-run one recorded prompt in the simulator with the calibration's inputs."""
    k = len(cal.profiles)
    traces = tuple(agreement_trace(rec, j + 1) for j in range(k - 1)) if use_traces else ()
    lookup = lookup_trace(rec) if use_traces and k > 1 and cal.profiles[0].kind == "lookup" else None
    cfg = SimConfig(
        method=rec["method"],
        lookahead=int(rec.get("lookahead") or 0) if rec["method"] != "ar" else 0,
        max_new_tokens=max(1, int(rec["n_new_tokens"])),
        max_run_ahead=int(rec.get("max_run_ahead") or max_run_ahead),
        max_verify=int(rec.get("max_verify") or max_verify),
        prompt_len=len(rec.get("prompt_ids") or []),
        latency_s=cal.down_latency_s,
        up_latency_s=cal.up_latency_s,
        blocking_reads=blocking_reads,
        seed=seed,
    )
    if cfg.method == "sd" and cfg.lookahead < 1:
        cfg = replace(cfg, lookahead=1)
    return simulate(cal.profiles, Acceptance(cal.rates, traces, lookup), cfg)


def run_decode_config(run_dir: str | Path) -> dict:
    """The run's ``decode`` settings from its .hydra/config.yaml, if Hydra wrote one."""
    path = Path(run_dir) / ".hydra" / "config.yaml"
    if not path.exists():
        return {}
    try:
        import yaml

        node = yaml.safe_load(path.read_text()) or {}
    except Exception:  # noqa: BLE001 - a run without a readable config keeps the defaults
        return {}
    dec = node.get("decode") or {}
    return {k: dec[k] for k in ("max_run_ahead", "max_verify") if isinstance(dec.get(k), int)}


def predict_run(
    run_dir: str | Path,
    scope: str = "method",
    use_traces: bool = True,
    max_run_ahead: int = 16,
    max_verify: int = 16,
    blocking_reads: bool = False,
) -> dict[str, dict]:
    """Measured vs predicted ms/token per method found in a run directory.

    scope="method" fits one calibration per method from all its records; scope="record" fits one
    per record (follows load that changes during the run on a shared machine).
    blocking_reads: the run was made with the old MPI RMA epochs window, whose header reads waited
    for a computing neighbour (before ``SharedEpochWindow``); current runs read headers at once.
    """
    recs = load_records(run_dir)
    decode = run_decode_config(run_dir)
    max_run_ahead = int(decode.get("max_run_ahead", max_run_ahead))
    max_verify = int(decode.get("max_verify", max_verify))
    by_method: dict[str, list[dict]] = {}
    for r in recs:
        by_method.setdefault(r["method"], []).append(r)
    out: dict[str, dict] = {}
    for method in [m for m in METHODS if m in by_method] + sorted(set(by_method) - set(METHODS)):
        rs = by_method[method]
        cal = calibrate(rs, blocking_reads) if scope == "method" else None
        wall = sim_wall = 0.0
        tokens = 0
        for r in rs:
            c = cal if cal is not None else calibrate([r], blocking_reads)
            sim = simulate_record(r, c, use_traces, max_run_ahead, max_verify, blocking_reads=blocking_reads)
            wall += float(r["wall_s"])
            tokens += int(r["n_new_tokens"])
            sim_wall += sim.wall_s
        measured = 1000.0 * wall / tokens if tokens else float("nan")
        predicted = 1000.0 * sim_wall / tokens if tokens else float("nan")
        row = {
            "measured_ms_per_token": measured,
            "predicted_ms_per_token": predicted,
            "error": predicted / measured - 1.0 if measured else float("nan"),
            "n_prompts": len(rs),
            "n_tokens": tokens,
        }
        if cal is not None:
            row["acceptance"] = list(cal.rates)
            row["latency_ms"] = [1000 * x for x in cal.down_latency_s]
            row["up_latency_ms"] = [1000 * x for x in cal.up_latency_s]
            row["overhead_ms"] = [1000 * p.overhead_s for p in cal.profiles]
        out[method] = row
    return out


# ============================================================================ the paper's setting
# Llama 3 on A100-40GB, HumanEval, greedy (McDanel et al., Table; /work/shared/PIPESPEC.md).
# Forward times: AR ms/token from the paper (70B: 123.69, 8B: 22.46) less 1 ms of loop overhead;
# the rest is derived from the authors' published per-forward times (benchmark_results/humaneval
# in github.com/BradMcDanel/pipespec): the 4-bit (bitsandbytes NF4) 70B takes ~0.12 s for a
# one-token forward but ~0.43 s for any multi-token forward (2..35 tokens: dequantisation
# dominates); the 8B verifying 2-4 tokens ~26.5 ms; the 1B ~11.5 ms per token (its AR run:
# 11.53 ms/token). Beyond the observed token counts the profiles are estimates (flat-ish: these
# GPUs are memory bound at small n). Loop overhead and per-message latency (shared-memory
# tensors polled by the reference code) are assumed: 1 ms each.
PAPER_OVERHEAD_S = 0.001
PAPER_LATENCY_S = 0.001
PAPER_PROFILES: dict[str, LatencyProfile] = {
    "1B": LatencyProfile("Llama-3.2-1B", ((1, 0.0105), (40, 0.0130)), overhead_s=PAPER_OVERHEAD_S),
    "8B": LatencyProfile(
        "Llama-3.1-8B", ((1, 0.02146), (4, 0.0265), (40, 0.040)), overhead_s=PAPER_OVERHEAD_S
    ),
    "70B": LatencyProfile(
        "Llama-3.1-70B-NF4", ((1, 0.12269), (2, 0.427), (40, 0.436)), overhead_s=PAPER_OVERHEAD_S
    ),
}
# Acceptance. The authors' result files record, for every target forward, how many tokens it
# committed ("accepted_tokens"). For the same prompt the greedy output is fixed, so those lists
# are per-position agreement traces of the pair along the target's output: c committed = c - 1
# agreements then a disagreement (taken as a rejection, not a bonus). Sample 9 (HumanEval
# "rolling_max", lookahead 0, async-chain_*.json) for the two pairs that end at the 70B:
PAPER_COMMITTED: dict[tuple[str, str], tuple[int, ...]] = {
    ("8B", "70B"): (
        4,
        5,
        18,
        19,
        19,
        10,
        4,
        5,
        13,
        5,
        8,
        5,
        2,
        5,
        2,
        5,
        2,
        5,
        18,
        2,
        5,
        18,
        19,
        9,
        5,
    ),  # fmt: skip
    ("1B", "70B"): (4, 5, 33, 5, 27, 4, 1, 5, 4, 5, 4, 4, 5, 11, 5, 8, 1, 5, 34, 19, 5),
}
# What the same sample says per target (or middle) forward: the tokens it committed on average,
# which the acceptance below is fitted to reproduce in the simulated PipeSpec (``fit_paper_rates``).
PAPER_COMMITTED_PER_FORWARD: dict[tuple[str, ...], tuple[int, float]] = {
    # hierarchy: (stage whose forwards are counted, committed tokens per forward)
    ("8B", "70B"): (1, 212 / 25),  # 8.48
    ("1B", "70B"): (1, 194 / 21),  # 9.24
    ("1B", "8B", "70B"): (1, 513 / 170),  # 3.02 per 8B forward
}
# Rates fitted by fit_paper_rates() (lookahead 4, 6 seeds): "trace" mode, the probability that
# the drafter's token agrees where the trace has no verdict (the last token of each
# verification: a correction, or a bonus the drafter may have matched); "iid" mode, the i.i.d.
# acceptance for every position.
PAPER_RATES: dict[str, dict[tuple[str, str], float]] = {
    "trace": {("8B", "70B"): 0.627, ("1B", "70B"): 0.424, ("1B", "8B"): 0.775},
    "iid": {("8B", "70B"): 0.958, ("1B", "70B"): 0.956, ("1B", "8B"): 0.787},
}
# The reference verifier publishes its output, waits for the drafter to acknowledge a rollback
# and for two drafts beyond its output, then verifies everything pending and never takes a step
# of its own. In this simulator, which runs this project's stage loop, that is PipeSpec with a
# lookahead and no caps (max_verify = max_run_ahead = 64); lookahead 4 reproduces the authors'
# tokens per forward best (their targets commit 4-5 tokens right after a rollback, and only
# lookahead >= 3 reproduces the 3-stage 8B's 3.02 tokens per forward), see docs/simulator.md.
PAPER_PIPESPEC_LOOKAHEAD = 4
PAPER_SD_WINDOW = 8
# the paper's reported results (ms/token), for comparison in the printed table
PAPER_TABLE: dict[tuple[str, tuple[str, ...]], float] = {
    ("ar", ("70B",)): 123.69,
    ("sd", ("8B", "70B")): 93.42,
    ("sd", ("1B", "8B", "70B")): 90.14,
    ("sd", ("1B", "70B")): 84.72,
    ("pipespec", ("1B", "70B")): 54.85,
    ("pipespec", ("8B", "70B")): 54.52,
    ("pipespec", ("1B", "8B", "70B")): 48.76,
}


def paper_rates(models: Sequence[str], rates: Mapping[tuple[str, str], float]) -> tuple[float, ...]:
    """Per-pair rates for a hierarchy of the paper's models (KeyError for an unknown pair)."""
    out = []
    for a, b in zip(models, models[1:]):
        if (a, b) not in rates:
            raise KeyError(f"no acceptance rate for the pair {a} -> {b}")
        out.append(rates[(a, b)])
    return tuple(out)


def committed_per_target_forward(r: SimResult) -> float:
    """The authors' "accepted tokens" metric: tokens the last stage committed per forward."""
    last = r.stages[-1]
    return r.n_tokens / last.forward_calls if last.forward_calls else float("nan")


def fit_rate(metric: Callable[[float], float], target: float, lo: float = 0.01, hi: float = 0.999) -> float:
    """The rate at which an increasing ``metric(rate)`` reaches ``target`` (bisection)."""
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        if metric(mid) < target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def committed_to_trace(committed: Sequence[int], boundary: bool | None = None) -> dict[int, bool]:
    """Per-position agreement from a list of tokens committed per verification: c - 1
    agreements, then the verifier's own token, which was either a correction (the drafter
    disagreed) or a bonus after all pending drafts (the drafter's next token may have agreed):
    ``boundary`` says which; None leaves those positions out (the pair's rate decides)."""
    trace: dict[int, bool] = {}
    pos = 0
    for c in committed:
        for q in range(int(c) - 1):
            trace[pos + q] = True
        if boundary is not None:
            trace[pos + int(c) - 1] = boundary
        pos += int(c)
    return trace


PAPER_RUNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ar", ("70B",)),
    ("sd", ("8B", "70B")),
    ("sd", ("1B", "8B", "70B")),
    ("sd", ("1B", "70B")),
    ("pipespec", ("1B", "70B")),
    ("pipespec", ("8B", "70B")),
    ("pipespec", ("1B", "8B", "70B")),
)


def paper_acceptance(
    models: Sequence[str],
    mode: str = "trace",
    rates: Mapping[tuple[str, str], float] | None = None,
) -> tuple[Acceptance, int | None]:
    """Acceptance for a hierarchy of the paper's models, and the trace length (tokens) if any."""
    if mode not in ("trace", "iid"):
        raise ValueError(f"acceptance mode {mode!r}: trace | iid")
    rates = dict(PAPER_RATES[mode] if rates is None else rates)
    pairs = list(zip(models, models[1:]))
    per_pair = paper_rates(models, rates)
    if mode == "iid":
        return Acceptance(per_pair), None
    traces = tuple(committed_to_trace(PAPER_COMMITTED[p]) if p in PAPER_COMMITTED else None for p in pairs)
    lengths = [sum(PAPER_COMMITTED[p]) for p in pairs if p in PAPER_COMMITTED]
    return Acceptance(per_pair, traces), (min(lengths) if lengths else None)


def _paper_cfg(
    method: str, look: int, n: int, max_run_ahead: int, max_verify: int, latency_s: float
) -> SimConfig:
    return SimConfig(
        method=method,
        lookahead=look,
        max_new_tokens=n,
        max_run_ahead=max_run_ahead,
        max_verify=max_verify,
        latency_s=latency_s,
        include_prefill=False,
    )


def fit_paper_rates(
    mode: str = "trace",
    seeds: Sequence[int] = tuple(range(8)),
    n_tokens: int = 256,
    lookahead: int = PAPER_PIPESPEC_LOOKAHEAD,
    max_run_ahead: int = 64,
    max_verify: int = 64,
) -> dict[tuple[str, str], float]:
    """Fit PAPER_RATES[mode]: each pair's rate so that the simulated PipeSpec commits as many
    tokens per forward as the authors' sample (PAPER_COMMITTED_PER_FORWARD); the 2-stage
    hierarchies first, then 1B -> 8B inside the 3-stage one."""
    rates = dict(PAPER_RATES[mode])

    def committed(models: tuple[str, ...], stage: int, trial: dict) -> float:
        acc, n_trace = paper_acceptance(models, mode, trial)
        cfg = _paper_cfg("pipespec", lookahead, n_trace or n_tokens, max_run_ahead, max_verify,
                         PAPER_LATENCY_S)  # fmt: skip
        tok = fw = 0
        for sd in seeds:
            r = simulate([PAPER_PROFILES[m] for m in models], acc, replace(cfg, seed=sd))
            st = r.stages[stage]
            tok += r.n_tokens if stage == len(models) - 1 else st.tokens_generated
            fw += st.forward_calls
        return tok / fw

    for models in (("8B", "70B"), ("1B", "70B"), ("1B", "8B", "70B")):
        stage, target = PAPER_COMMITTED_PER_FORWARD[models]
        pair = (models[stage - 1], models[stage])

        def metric(a: float, models=models, stage=stage, pair=pair) -> float:
            return committed(models, stage, {**rates, pair: a})

        rates[pair] = round(fit_rate(metric, target), 3)
    return rates


def paper_rows(
    n_tokens: int = 256,
    seeds: Sequence[int] = tuple(range(8)),
    max_run_ahead: int = 64,
    max_verify: int = 64,
    sd_window: int = PAPER_SD_WINDOW,
    pipespec_lookahead: int = PAPER_PIPESPEC_LOOKAHEAD,
    acceptance: str = "trace",
    rates: Mapping[tuple[str, str], float] | None = None,
    latency_s: float = PAPER_LATENCY_S,
    profiles: Mapping[str, LatencyProfile] | None = None,
    blocking_reads: bool = False,
) -> list[dict]:
    """AR, SD and PipeSpec over the paper's hierarchies, in the paper's setting.

    acceptance="trace" replays the authors' recorded acceptance along the target's output (and
    simulates that many tokens); "iid" uses the per-pair rates for ``n_tokens`` tokens.
    """
    profiles = dict(PAPER_PROFILES if profiles is None else profiles)
    rows = []
    ar_ms = None
    for method, models in PAPER_RUNS:
        if len(models) > 1:
            acc, n_trace = paper_acceptance(models, acceptance, rates)
        else:
            acc, n_trace = Acceptance(()), None
        look = {"ar": 0, "sd": sd_window, "pipespec": pipespec_lookahead}[method]
        cfg = _paper_cfg(method, look, n_trace or n_tokens, max_run_ahead, max_verify, latency_s)
        cfg = replace(cfg, blocking_reads=blocking_reads)
        ms = mean_ms_per_token([profiles[m] for m in models], acc, cfg, seeds)
        if method == "ar":
            ar_ms = ms
        rows.append(
            {
                "method": method,
                "models": list(models),
                "speedup": ar_ms / ms if ar_ms else float("nan"),
                "ms_per_token": ms,
            }
        )
    return rows


# ============================================================================ command line
def format_paper_table(rows: Sequence[dict]) -> str:
    lines = [
        f"{'method':<9} {'models':<16} {'ms/token':>9} {'speedup':>8}   "
        f"{'paper ms/token':>14} {'paper speedup':>13}"
    ]
    ar = PAPER_TABLE[("ar", ("70B",))]
    for r in rows:
        p = PAPER_TABLE.get((r["method"], tuple(r["models"])))
        ps = f"{p:>14.2f} {ar / p:>12.2f}x" if p else f"{'-':>14} {'-':>13}"
        lines.append(
            f"{r['method']:<9} {' -> '.join(r['models']):<16} {r['ms_per_token']:>9.2f} "
            f"{r['speedup']:>7.2f}x   {ps}"
        )
    return "\n".join(lines)


def format_run_table(res: Mapping[str, Mapping], run_dir: str) -> str:
    lines = [
        f"run {run_dir}",
        f"{'method':<9} {'prompts':>7} {'tokens':>7} {'measured':>9} {'predicted':>10} {'error':>7}"
        f"   acceptance / latency ms (down, up) / overhead ms per stage",
    ]
    for m, r in res.items():
        extra = ""
        if "acceptance" in r:
            extra = (
                f"   {[round(x, 3) for x in r['acceptance']]} / "
                f"{[round(x, 2) for x in r['latency_ms']]}, {[round(x, 2) for x in r['up_latency_ms']]}"
                f" / {[round(x, 2) for x in r['overhead_ms']]}"
            )
        lines.append(
            f"{m:<9} {r['n_prompts']:>7} {r['n_tokens']:>7} {r['measured_ms_per_token']:>9.2f} "
            f"{r['predicted_ms_per_token']:>10.2f} {100 * r['error']:>+6.1f}%{extra}"
        )
    return "\n".join(lines)


def calibration_rows(run_dirs: Sequence[str | Path], **kw) -> list[dict]:
    """One row per (run, method): measured and predicted ms/token."""
    rows = []
    for d in run_dirs:
        recs = load_records(d)
        hier = (recs[0].get("hierarchy") or f"{len(recs[0]['stages'])} stages") if recs else "?"
        look = sorted({int(r.get("lookahead") or 0) for r in recs if r["method"] != "ar"})
        tokens = max((int(r.get("max_new_tokens") or 0) for r in recs), default=0)
        for m, r in predict_run(d, **kw).items():
            rows.append({"run": Path(d).name, "hierarchy": hier, "lookahead": look, "max_new_tokens": tokens,
                         "method": m, **r})  # fmt: skip
    return rows


def format_calibration_markdown(rows: Sequence[dict]) -> str:
    lines = [
        "| run | hierarchy | lookahead | tokens/prompt | method | prompts | measured ms/token "
        "| predicted ms/token | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        look = ",".join(map(str, r["lookahead"])) if r["method"] != "ar" else "-"
        lines.append(
            f"| {r['run']} | {r['hierarchy']} | {look} | {r['max_new_tokens']} | {r['method']} | "
            f"{r['n_prompts']} | {r['measured_ms_per_token']:.2f} | {r['predicted_ms_per_token']:.2f} | "
            f"{100 * r['error']:+.1f}% |"
        )
    return "\n".join(lines)


def plot_calibration(rows: Sequence[dict], path: str | Path) -> None:
    """Predicted vs measured ms/token, one point per (run, method), with the +-15% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    colors = {"ar": "tab:gray", "sd": "tab:blue", "pipespec": "tab:red"}
    xs = [r["measured_ms_per_token"] for r in rows]
    lo, hi = min(xs) * 0.7, max(xs) * 1.4
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="predicted = measured")
    ax.fill_between([lo, hi], [0.85 * lo, 0.85 * hi], [1.15 * lo, 1.15 * hi], color="0.9", label="+-15%")
    for m, c in colors.items():
        sel = [r for r in rows if r["method"] == m]
        if sel:
            ax.scatter([r["measured_ms_per_token"] for r in sel], [r["predicted_ms_per_token"] for r in sel],
                       color=c, label=m, zorder=3, s=28)  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("measured ms/token")
    ax.set_ylabel("simulated ms/token")
    ax.set_title("Simulator vs runs of this project (CPU)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m pipespec_mpi.simulate",
        description="Discrete-event simulator of AR, SD and PipeSpec (docs/simulator.md).",
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=["paper"], help="the paper's setting (Llama 3, A100s)")
    src.add_argument("--from", dest="run_dir", help="a run directory: predict its ms/token")
    src.add_argument("--fit-paper-rates", action="store_true", help="re-derive PAPER_RATES (slow: ~1 min)")
    src.add_argument("--calibration", nargs="+", metavar="RUN_DIR", help="several runs: a markdown table")
    ap.add_argument("--plot", help="with --calibration: write predicted vs measured to this PNG")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    ap.add_argument("--acceptance", choices=["trace", "iid"], default="trace",
                    help="paper: replay the authors' acceptance traces, or i.i.d. rates")  # fmt: skip
    ap.add_argument("--seeds", type=int, default=8, help="paper: simulations per row")
    ap.add_argument("--lookahead", type=int, default=PAPER_PIPESPEC_LOOKAHEAD,
                    help="paper: PipeSpec lookahead")  # fmt: skip
    ap.add_argument("--sd-window", type=int, default=PAPER_SD_WINDOW, help="paper: SD window")
    ap.add_argument("--blocking-reads", action="store_true",
                    help="header reads wait for a computing stage (the old MPI RMA window): "
                         "paper: simulate it; runs: records made before SharedEpochWindow")  # fmt: skip
    ap.add_argument("--max-run-ahead", type=int, default=None,
                    help="default: 64 for the paper (uncapped reference), 16 for runs")  # fmt: skip
    ap.add_argument("--max-verify", type=int, default=None, help="default: as --max-run-ahead")
    ap.add_argument("--scope", choices=["method", "record"], default="method",
                    help="runs: one calibration per method, or per record")  # fmt: skip
    ap.add_argument("--iid", action="store_true",
                    help="runs: i.i.d. acceptance instead of the records' traces")  # fmt: skip
    a = ap.parse_args(argv)
    try:
        if a.fit_paper_rates:
            rates = fit_paper_rates(a.acceptance, lookahead=a.lookahead)
            out = {f"{x} -> {y}": v for (x, y), v in rates.items()}
            print(json.dumps(out, indent=2) if a.json else out)
            return 0
        if a.preset:
            cap = a.max_run_ahead or 64
            rows = paper_rows(
                seeds=tuple(range(max(1, a.seeds))),
                max_run_ahead=cap,
                max_verify=a.max_verify or cap,
                sd_window=a.sd_window,
                pipespec_lookahead=a.lookahead,
                acceptance=a.acceptance,
                blocking_reads=a.blocking_reads,
            )
            print(json.dumps(rows, indent=2) if a.json else format_paper_table(rows))
            return 0
        cap = a.max_run_ahead or 16
        if a.calibration:
            rows = calibration_rows(a.calibration, scope=a.scope, use_traces=not a.iid, max_run_ahead=cap,
                                    max_verify=a.max_verify or cap,
                                    blocking_reads=a.blocking_reads)  # fmt: skip
            print(json.dumps(rows, indent=2) if a.json else format_calibration_markdown(rows))
            if a.plot:
                plot_calibration(rows, a.plot)
            return 0
        res = predict_run(
            a.run_dir,
            scope=a.scope,
            use_traces=not a.iid,
            max_run_ahead=cap,
            max_verify=a.max_verify or cap,
            blocking_reads=a.blocking_reads,
        )
    except (OSError, ValueError, KeyError) as err:
        print(f"pipespec_mpi.simulate: {err}", file=sys.stderr)
        return 2
    if a.json:
        out = {
            m: {k: r[k] for k in ("measured_ms_per_token", "predicted_ms_per_token")} for m, r in res.items()
        }
        print(json.dumps(out, indent=2))
    else:
        print(format_run_table(res, a.run_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
