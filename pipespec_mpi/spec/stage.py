"""The stage loop: one per rank, all stages running at once (PipeSpec, and the AR/SD baselines).

Every iteration of stage i:
  1. read the downstream's header from the epochs window; on a new epoch adopt its committed
     tokens (cut the KV cache back, drop pending proposals, bump our own epoch so the rollback
     cascades upstream); if it is simply ahead of us, catch up with its tokens
  2. poll proposals from upstream; drop those of an older epoch or prompt, fold the rest into the
     inbox; a proposal contradicting our committed tokens bumps our epoch (rollback upstream)
  3. act, by method:
       first stage   draft one token (model) or a lookup continuation, within its run-ahead bound
       verifier      verify pending proposals in one forward once ``lookahead`` are pending;
                     with lookahead 0 and nothing pending, take its own one-token step
       sd            the same roles, but each stage waits for its drafter's full window and the
                     drafter only works when asked (the ``want`` field of the window)
       ar            the last stage steps alone
  4. publish committed tokens and header; send new committed tokens downstream
The last stage stops at EOS or ``max_new_tokens`` and raises ``done``; each stage relays it up.
Waiting polls with backoff and never spins.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pipespec_mpi.comm.channel import Receiver, Sender
from pipespec_mpi.comm.wait import Backoff, StallError, wait_until
from pipespec_mpi.comm.window import EpochWindow, Header, SharedEpochWindow
from pipespec_mpi.config import DecodeConfig
from pipespec_mpi.spec.greedy import Verdict, verify_against
from pipespec_mpi.spec.sampling import Sampler, draw, mix, speculative_verify
from pipespec_mpi.spec.sequence import Inbox, adopt

# Test hook: PIPESPEC_BROKEN_VERIFIER=1 makes every verifier accept all proposals, so that the
# statistical tests can show they detect a wrong verifier. Never set it otherwise.
BROKEN_VERIFIER = os.environ.get("PIPESPEC_BROKEN_VERIFIER") == "1"


@dataclass
class StageStats:
    stage: int
    rank: int
    model: str
    forward_calls: int = 0
    draft_steps: int = 0
    own_steps: int = 0
    verifications: int = 0
    tokens_proposed: int = 0  # tokens this stage sent downstream
    tokens_verified: int = 0  # proposal tokens this stage checked
    tokens_accepted: int = 0  # proposal tokens this stage accepted
    rollbacks: int = 0  # times this stage was rolled back by its downstream
    rollbacks_signalled: int = 0  # epoch bumps (rollbacks this stage asked upstream for)
    tokens_discarded: int = 0  # own tokens thrown away by rollbacks
    discarded_s: float = 0.0  # compute time spent on those tokens
    dropped_messages: int = 0  # proposals of an old epoch or prompt
    busy_s: float = 0.0
    wait_s: float = 0.0
    prefill_s: float = 0.0
    t0_perf_counter: float = 0.0  # this rank's time.perf_counter() at the prompt start (shared
    # clock across the processes of one node; timeline times are relative to it)
    verify_trace: list[list[int]] = field(default_factory=list)  # [n_proposed, n_accepted]
    timeline: list[list] = field(default_factory=list)  # [t0, t1, kind, n_tokens, context]
    commit_times: list[list[float]] = field(default_factory=list)  # [t, n_committed] (last stage)
    peak_rss_mb: float = 0.0  # this rank's peak resident memory so far
    bytes_sent: int = 0  # proposal bytes sent downstream (ids, and distributions when sampling)
    gpus: list[dict] = field(default_factory=list)  # NVML per device: energy_j, util_mean, mem_peak_mb

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class StageRole:
    stage: int
    n_stages: int
    rank: int
    upstream: int | None
    downstream: int | None

    @property
    def is_last(self) -> bool:
        return self.downstream is None


@dataclass
class StageOutcome:
    tokens: list[int]
    finish_reason: str
    stats: StageStats


class StageLoop:
    """Runs one stage through one prompt. Parts are injected so they can be replaced in tests."""

    def __init__(
        self,
        role: StageRole,
        model,  # Scorer or Proposer
        window: EpochWindow | SharedEpochWindow,
        sender: Sender | None,
        receiver: Receiver | None,
        decode: DecodeConfig,
        eos_token_id: int,
        stall_timeout_s: float,
        record_timeline: bool = True,
        vocab: int = 0,
    ) -> None:
        self.role, self.model, self.win = role, model, window
        self.sender, self.receiver = sender, receiver
        self.cfg = decode
        self.eos = eos_token_id
        self.stall_timeout_s = stall_timeout_s
        self.record_timeline = record_timeline
        self.is_scorer = hasattr(model, "logits")
        self.vocab = vocab  # width of the distributions that travel with proposals (sampling)

    # ------------------------------------------------------------------ helpers
    def _wait(self, cond, what: str) -> None:
        """Wait for a channel (e.g. a free send buffer), keeping our heartbeat fresh."""
        wait_until(
            lambda: self.win.beat() or cond(), self.stall_timeout_s, f"stage {self.role.stage}: {what}"
        )

    def _event(self, t0: float, t1: float, kind: str, n: int) -> None:
        if self.record_timeline:
            self.stats.timeline.append([round(t0 - self.t_start, 6), round(t1 - self.t_start, 6),
                                        kind, n, len(self.prompt) + len(self.out)])  # fmt: skip

    def _publish(self, done: bool = False) -> None:
        self.win.publish(
            prompt=self.seq, epoch=self.epoch, tokens=self.out, dirty_from=self.dirty_from,
            done=done, want=self.want, idle=self.idle,
        )  # fmt: skip
        self.dirty_from = len(self.out)

    def _bump_epoch(self) -> None:
        """Tell the upstream stage to roll back to our committed tokens."""
        self.inbox.clear()
        self.epoch += 1
        self.stats.rollbacks_signalled += 1

    @property
    def _capped(self) -> bool:
        return len(self.out) >= self.cfg.max_new_tokens or (bool(self.out) and self.out[-1] == self.eos)

    def _commit(self, tokens: list[int], cost_s: float) -> None:
        if self.eos in tokens:
            tokens = tokens[: tokens.index(self.eos) + 1]
        tokens = tokens[: self.cfg.max_new_tokens - len(self.out)]
        self.out.extend(tokens)
        self.cost.extend([cost_s / max(1, len(tokens))] * len(tokens))
        if self.role.is_last:
            self.stats.commit_times.append([round(time.perf_counter() - self.t_start, 6), len(self.out)])

    def _full(self) -> list[int]:
        return self.prompt + self.out

    # ------------------------------------------------------------------ stage actions
    def _step(self, kind: str) -> None:
        """One greedy token of our own (draft step of the first stage, or a verifier's own step)."""
        t0 = time.perf_counter()
        n0 = len(self.out)
        logits = self.model.logits(self._full(), [])
        if self.sampler.leviathan:
            p = self.sampler.probs(logits[-1:])[0]
            tok = draw(p, self.gen)
            if self.sender is not None:  # only tokens that travel need their distribution
                self.rows[n0] = p.float().numpy()
        else:
            tok = int(self.sampler.tokens(logits[-1:], n0)[0])
        t1 = time.perf_counter()
        self.stats.forward_calls += 1
        self._commit([tok], t1 - t0)
        self.model.truncate(len(self.prompt) + len(self.out) - 1)
        if kind == "draft":
            self.stats.draft_steps += 1
        else:
            self.stats.own_steps += 1
            if not self.inbox.advance(self.out, n0):
                self._bump_epoch()
        self.stats.busy_s += t1 - t0
        self._event(t0, t1, kind, 1)

    def _lookup(self, limit: int) -> bool:
        t0 = time.perf_counter()
        toks = self.model.propose(self._full(), limit)
        t1 = time.perf_counter()
        self.stats.busy_s += t1 - t0
        if not toks:
            return False
        self.stats.draft_steps += 1
        if self.sampler.leviathan:  # deterministic proposals: q is a point mass
            for k, tok in enumerate(toks):
                row = np.zeros(self.vocab, dtype=np.float32)
                row[tok] = 1.0
                self.rows[len(self.out) + k] = row
        self._commit(toks, t1 - t0)
        self._event(t0, t1, "draft", len(toks))
        return True

    def _verify(self, n: int) -> None:
        proposal = self.inbox.tokens[:n]
        t0 = time.perf_counter()
        n0 = len(self.out)
        logits = self.model.logits(self._full(), proposal)  # [n+1, V]
        if self.sampler.leviathan:
            p = self.sampler.probs(logits)  # [n+1, V]
            q = torch.from_numpy(np.stack(self.inbox.rows[:n])).double() if n else p[:0]  # [n, V]
            m, nxt = speculative_verify(proposal, q[:, : p.shape[1]], p, self.gen)
            if BROKEN_VERIFIER:
                m, nxt = n, draw(p[n], self.gen)
            verdict = Verdict(n, m, nxt)
            for j in range(m + 1 if self.sender is not None else 0):
                self.rows[n0 + j] = p[j].float().numpy()  # what we emit is distributed as p: it travels as q
        else:
            target = self.sampler.tokens(logits, n0)  # [n+1]: our own choices at n0..n0+n
            verdict = verify_against(proposal, target)
            if BROKEN_VERIFIER:  # test hook: accept everything (must be caught by the tests)
                verdict = Verdict(n, n, int(target[n]))
        t1 = time.perf_counter()
        self.stats.forward_calls += 1
        self.stats.verifications += 1
        self.stats.tokens_verified += n
        self.stats.tokens_accepted += verdict.n_accepted
        self.stats.verify_trace.append([n, verdict.n_accepted])
        self._commit(verdict.committed(proposal), t1 - t0)
        self.model.truncate(len(self.prompt) + len(self.out) - 1)
        if verdict.rejected or not self.inbox.advance(self.out, n0):
            self._bump_epoch()
        self.stats.busy_s += t1 - t0
        self._event(t0, t1, "verify", n)

    # ------------------------------------------------------------------ synchronisation
    def _sync_downstream(self) -> bool:
        """Apply the downstream's rollback epoch or catch up with it. Returns True when done."""
        h = self.win.header(self.role.downstream)
        if h.prompt > self.seq:
            return True  # the downstream finished this prompt and moved on
        if h.prompt != self.seq:
            return False  # the downstream has not started this prompt yet
        self.down = h
        while self.rows_floor < h.length:  # the downstream holds these: their rows are not needed
            self.rows.pop(self.rows_floor, None)
            self.rows_floor += 1
        if h.done:
            return True
        if h.epoch != self.seen_down_epoch or h.length > len(self.out):
            h, theirs = self.win.snapshot(self.role.downstream)
            self.down = h
            epoch_changed = h.epoch != self.seen_down_epoch
            old = len(self.out)
            a = adopt(self.out, theirs)
            if a.discarded:
                self.stats.rollbacks += 1
                self.stats.tokens_discarded += a.discarded
                self.stats.discarded_s += sum(self.cost[a.keep :])
            self.cost = self.cost[: a.keep] + [0.0] * (len(a.tokens) - a.keep)
            self.out = a.tokens
            self.dirty_from = min(self.dirty_from, a.keep)
            if self.is_scorer:
                self.model.truncate(len(self.prompt) + min(a.keep, len(self.out) - 1))
            if epoch_changed:
                self.seen_down_epoch = h.epoch
                self.sent = min(len(self.out), len(theirs))
            else:
                self.sent = max(self.sent, len(theirs)) if not a.discarded else len(theirs)
            if self.role.upstream is not None and (a.discarded or not self.inbox.advance(self.out, old)):
                self._bump_epoch()
            self._publish()
        return False

    def _poll_upstream(self) -> None:
        for msg in self.receiver.poll():
            if msg.prompt != self.seq or msg.epoch != self.epoch:
                self.stats.dropped_messages += 1
                continue
            rows = None if msg.dists is None else list(msg.dists)
            if not self.inbox.merge(self.out, msg.start, msg.tokens, rows):
                self._bump_epoch()
                self._publish()

    def _send_new(self) -> None:
        if self.sender is None or self.sent >= len(self.out):
            return
        toks = self.out[self.sent :]
        dists = None
        if self.sampler.leviathan:
            dists = np.stack([self.rows[pos] for pos in range(self.sent, len(self.out))])
        before = self.sender.bytes_sent
        self.sender.send(self._wait, self.seq, self.seen_down_epoch, self.sent, toks, dists)
        self.stats.bytes_sent += self.sender.bytes_sent - before
        self.stats.tokens_proposed += len(toks)
        self.sent = len(self.out)

    # ------------------------------------------------------------------ policy
    def _room(self, method: str) -> int:
        """How many more tokens this stage may commit now (run-ahead bound / SD demand)."""
        room = self.cfg.max_new_tokens - len(self.out)
        if self.role.is_last:
            return room
        down_len = self.down.length if self.down else 0
        if method == "sd":
            want = self.down.want if self.down else 0
            return min(room, max(0, want - len(self.out)))
        return min(room, self.cfg.max_run_ahead - (len(self.out) - down_len))

    def _upstream_idle(self) -> bool:
        h: Header = self.win.header(self.role.upstream)
        return h.prompt == self.seq and h.idle

    def _act(self, method: str) -> bool:
        """Do one unit of work if there is one; returns False when the stage has to wait."""
        if self._capped:
            self.idle = True
            return False
        room = self._room(method)
        if room <= 0:
            self.idle = False  # blocked by the bound/demand, not starved
            return False
        if method == "ar":  # the last model alone
            self._step("own")
            return True
        if self.role.upstream is None:  # first stage: a drafter
            if self.is_scorer:
                self._step("draft")
                return True
            hit = self._lookup(room)
            self.idle = not hit
            return hit
        # A verifier commits up to n+1 tokens for n verified. The last stage keeps that within
        # max_new_tokens; other stages may overshoot their bound/demand by the bonus token.
        budget = room if self.role.is_last else self.cfg.max_new_tokens - len(self.out)
        limit = min(self.cfg.max_verify, budget - 1)
        pending = len(self.inbox.tokens)
        if method == "sd":
            window = min(self.cfg.window("sd"), limit)
            self.want = len(self.out) + window
            if window == 0:
                self._step("own")
                return True
            if pending >= window:
                self._verify(window)
                return True
        else:
            need = max(1, min(self.cfg.lookahead, limit))
            if pending >= need and limit >= 1:
                self._verify(min(pending, limit))
                return True
            if self.cfg.lookahead == 0:
                self._step("own")
                return True
        if self._upstream_idle():  # the upstream cannot give us more: work on what we have
            if pending and limit >= 1:
                self._verify(min(pending, limit))
            else:
                self._step("own")
            return True
        return False

    # ------------------------------------------------------------------ the loop
    def reset(self, seq: int) -> None:
        """Publish a fresh header for prompt ``seq`` (called before the start barrier)."""
        self.seq, self.epoch, self.out, self.dirty_from = seq, 0, [], 0
        self.want, self.idle = 0, False
        self._publish()

    def run(
        self, seq: int, prompt: Sequence[int], method: str, sampler: Sampler | None = None
    ) -> StageOutcome:
        self.sampler = sampler or Sampler()
        self.gen = torch.Generator().manual_seed(mix(self.sampler.key, self.role.stage))
        self.rows: dict[int, np.ndarray] = {}  # leviathan: position -> distribution of our token
        self.rows_floor = 0
        self.stats = StageStats(self.role.stage, self.role.rank, getattr(self.model, "name", "?"))
        self.prompt = list(prompt)
        self.seq, self.epoch, self.seen_down_epoch = seq, 0, 0
        self.out, self.cost, self.sent, self.dirty_from = [], [], 0, 0
        self.want, self.idle = 0, False
        self.down: Header | None = None
        self.inbox = Inbox()
        self.t_start = time.perf_counter()
        self.stats.t0_perf_counter = self.t_start
        if method == "ar" and not self.role.is_last:  # AR: the last model alone; others idle
            self._publish(done=True)
            return StageOutcome(tokens=[], finish_reason="idle", stats=self.stats)
        # the sequence reaches prompt + max_new_tokens, plus a proposal under verification
        self.model.prefill(self.prompt, room=self.cfg.max_new_tokens + self.cfg.max_verify + 1)
        t1 = time.perf_counter()
        self.stats.prefill_s = t1 - self.t_start
        self._event(self.t_start, t1, "prefill", len(self.prompt))
        finish = self._loop(method)
        if self._wait_t0 is not None:
            self._close_wait(self._wait_t0, time.perf_counter())
        self._publish(done=True)
        return StageOutcome(tokens=list(self.out), finish_reason=finish, stats=self.stats)

    def _loop(self, method: str) -> str:
        backoff = Backoff()
        last_progress = time.monotonic()
        self._wait_t0: float | None = None
        while True:
            self.win.beat()
            if self.role.downstream is not None and self._sync_downstream():
                return "done"
            if self.receiver is not None and method != "ar":
                self._poll_upstream()
            if self.role.is_last and self._capped:
                return "eos" if self.out and self.out[-1] == self.eos else "length"
            want, idle = self.want, self.idle
            t_act = time.perf_counter()
            acted = self._act(method)
            if acted:
                if self._wait_t0 is not None:
                    self._close_wait(self._wait_t0, t_act)
                    self._wait_t0 = None
                self._publish()
                self._send_new()
                backoff.reset()
                last_progress = time.monotonic()
                continue
            if (want, idle) != (self.want, self.idle):
                self._publish()
            if self._wait_t0 is None:
                self._wait_t0 = time.perf_counter()
            if time.monotonic() - last_progress > self.stall_timeout_s:
                raise StallError(
                    f"stage {self.role.stage} (rank {self.role.rank}) made no progress for "
                    f"{self.stall_timeout_s:.0f} s: upstream rank {self.role.upstream}, "
                    f"downstream rank {self.role.downstream} stopped answering"
                )
            backoff.sleep()

    def _close_wait(self, t0: float, t1: float) -> None:
        self.stats.wait_s += t1 - t0
        self._event(t0, t1, "wait", 0)
