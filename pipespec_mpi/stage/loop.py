"""The stage loop: one per rank, all stages running at once (PipeSpec, and the AR/SD baselines).

``StageLoop.step()`` is one iteration of stage i:
  1. read the downstream's header from the epochs window; on a new epoch adopt its committed
     tokens (cut the KV cache back, drop pending proposals, bump our own epoch so the rollback
     cascades upstream); if it is simply ahead of us, catch up with its tokens
  2. send what the downstream is owed: tokens it has not got, which after an epoch change that
     kept our tokens are sent again (greedy and Gumbel) or drawn again (Leviathan: a token
     travels at most once), whether or not this stage acts now
  3. take the proposals that arrived from upstream; drop those of an older epoch or prompt, fold
     the rest into the inbox; a proposal contradicting our committed tokens bumps our epoch
  4. decide through the policy (speculative/policy.py ``Policy``) and act: a draft or lookup, a
     verification, an own step, or wait; publish the header and send what is new
The last stage stops at EOS or the prompt's ``max_new_tokens`` and raises ``done``; each stage relays it up.
Every part is a port (stage/ports.py), so ranks, the simulator and the schedule explorer all
drive this one loop; a driver calls ``step()`` until it says DONE, sleeping while it says WAITING.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipespec_mpi.config import DecodeConfig
from pipespec_mpi.speculative.policy import (
    Act,
    Arrived,
    Decision,
    Fate,
    Forwarded,
    Judged,
    Policy,
    Restarted,
    View,
    make_policy,
)
from pipespec_mpi.speculative.sequence import Inbox, adopt, adopt_sent_once
from pipespec_mpi.speculative.verifiers import Checked, Question, Verifier, check_all
from pipespec_mpi.stage.ledger import Ledger
from pipespec_mpi.stage.mailbox import Mailbox
from pipespec_mpi.stage.outbox import Outbox
from pipespec_mpi.stage.ports import Header, Proposer, Scorer, StagePorts, StageRole
from pipespec_mpi.stage.stats import StageOutcome, StageStats, Trace


class Step(enum.Enum):
    ACTED = "acted"  # a forward or a lookup
    PROGRESS = "progress"  # no forward, but something changed (tokens adopted or sent, proposals taken)
    WAITING = "waiting"  # nothing to do until a neighbour moves
    DONE = "done"  # this prompt is finished on this stage: call finish()


@dataclass(frozen=True)
class Forward:
    """A forward a stage decided on: the logits after ``seq`` (prompt + committed tokens) and
    each prefix of ``proposal`` ([len(proposal)+1, V]); ``act`` is DRAFT, OWN or VERIFY."""

    act: Act
    seq: list[int]
    proposal: list[int]


class StageLoop:
    """One stage decoding prompts one after another: ``reset(seq)`` before the start of a prompt,
    ``begin(...)`` at its start, ``step()`` until DONE, ``finish()``; ``pump()`` while waiting
    between prompts."""

    def __init__(
        self,
        role: StageRole,
        model: Scorer | Proposer,
        ports: StagePorts,
        decode: DecodeConfig,
        eos_token_id: int,
        *,
        vocab: int = 0,
        record_timeline: bool = True,
        policy: Policy | None = None,
    ) -> None:
        self.role, self.model, self.win, self.clock = role, model, ports.window, ports.clock
        self.sender = ports.sender
        self.mailbox = Mailbox(ports.receiver)
        # how it decides and what it learns, kept across prompts (default: decode.policy's)
        self.policy = policy if policy is not None else make_policy(decode, ports.clock.now)
        self.eos = eos_token_id
        self.vocab = vocab  # width of the distributions that travel with proposals (sampling)
        self.record_timeline = record_timeline
        self.is_scorer = hasattr(model, "logits")
        self.seq = -1
        # a waiting stage's next moment to decide again although nothing it sees changed (a
        # policy's wait stops paying as the upstream stays silent); None: on change only
        self.recheck_at: float | None = None
        self.waits_for_upstream = False  # the last iteration waited for more proposals by choice

    @property
    def cfg(self) -> DecodeConfig:
        """The decode settings, the policy's (a phase's: ``enter_phase``)."""
        return self.policy.cfg

    def enter_phase(self, decode: DecodeConfig) -> None:
        """Between prompts: decide under a phase's settings (a batch size's, DecodeConfig.for_batch)
        by a policy made for them from this one, what it learned carried over."""
        if self.seq >= 0 and self.finish_reason is None:
            raise RuntimeError(f"stage {self.role.stage}: a phase change with prompt {self.seq} in flight")
        self.policy = self.policy.for_phase(decode)

    # ------------------------------------------------------------------ prompt boundaries
    def reset(self, seq: int) -> None:
        """Publish a fresh header for prompt ``seq`` (before the start of the prompt)."""
        self.seq, self.epoch, self.seen_down_epoch = seq, 0, 0
        self.out: list[int] = []
        self.ledger = Ledger()
        self.outbox = Outbox(self.role.stage, self.sender)
        self.dirty_from = 0
        self.want, self.idle = 0, False
        self.published: tuple[int, bool, int, int] | None = None
        self.down: Header | None = None
        self.inbox = Inbox()
        self.finish_reason: str | None = None
        self.stats = StageStats(self.role.stage, self.role.rank, getattr(self.model, "name", "?"))
        self.trace = Trace(self.stats, self.record_timeline)
        self._publish()

    def pump(self) -> None:
        """Between prompts: take in what has arrived (kept for its prompt), keep the heartbeat."""
        self.win.beat()
        self.mailbox.pump()

    def begin(
        self,
        prompt: Sequence[int],
        method: str,
        verifier: Verifier,
        max_new_tokens: int | None = None,
        store_key: str | None = None,
        idle: bool = False,
    ) -> None:
        """Start decoding ``prompt`` (after ``reset``): prefill, then ``step()``. ``max_new_tokens``:
        this prompt's budget, at most the configured one (the window and buffers are sized by it);
        ``store_key``: a drafter's job store for this sequence (default: the method's); ``idle``:
        this stage sits the prompt out (a route without it: run/online.py)."""
        self.prompt, self.method, self.verifier = list(prompt), method, verifier
        self.limit = min(max_new_tokens or self.cfg.max_new_tokens, self.cfg.max_new_tokens)
        t0 = self.clock.now()
        self.trace.start(t0)
        if idle or (method == "ar" and not self.role.is_last):  # AR: the last model alone; the others idle
            self.finish_reason = "idle"
            return
        # the sequence reaches prompt + max_new_tokens, plus a proposal under verification
        room = self.limit + self.cfg.max_verify + 1
        if self.is_scorer:
            self.model.prefill(self.prompt, room=room)
        else:  # a drafter's job store (models/suffix.py)
            self.model.prefill(self.prompt, room=room, store_key=store_key or method)
        t1 = self.clock.now()
        self.stats.prefilled(t1 - t0)
        self.trace.event(t0, t1, "prefill", len(self.prompt), len(self.prompt))

    def finish(self) -> StageOutcome:
        """After DONE: publish ``done`` (relayed upstream) and hand over the outcome."""
        t = self.clock.now()
        self._wait_ends(t)
        if not self.is_scorer and self.finish_reason != "idle":
            self.stats.drafter = self.model.end_sequence(self.out[: self._confirmed()])
        if self.finish_reason != "idle":
            self.stats.chose(*self.policy.report())
        self._publish(done=True)
        return StageOutcome(list(self.out), self.finish_reason or "done", t - self.trace.t_start, self.stats)

    # ------------------------------------------------------------------ one iteration
    def step(self) -> Step:
        """One iteration, its forward (if any) run alone."""
        s = self.advance()
        return self.run_forward(s) if isinstance(s, Forward) else s

    def run_forward(self, fwd: Forward) -> Step:
        """Run the forward ``advance`` asked for on this stage's model alone, then complete it."""
        t0 = self.clock.now()
        return self.answer(fwd, self.model.logits(fwd.seq, fwd.proposal), t0)

    def answer(self, fwd: Forward, logits: torch.Tensor, t0: float) -> Step:
        """``complete`` with the forward's logits ([len(fwd.proposal)+1, V]) checked alone."""
        return self.complete(fwd, check_all([self.question(fwd, logits)])[0], t0)

    def question(self, fwd: Forward, logits: torch.Tensor) -> Question:
        """What the forward's logits must answer under this stage's rule (``check_all``)."""
        n = len(fwd.proposal)
        dists = self.inbox.rows[:n] if n and self.verifier.carries_dists else None
        return Question(self.verifier, fwd.proposal, logits, len(self.out), dists)

    def advance(self, joining: bool = False) -> Step | Forward:
        """One iteration up to its forward: a ``Step``, or the ``Forward`` decided on, which the
        driver runs (alone, or batched with other slots' forwards) and hands to ``complete``.
        ``joining``: the stage's other slots forward now, so the policy need not wait for more
        proposals (``waits_for_upstream`` says when an iteration did: stage/batch.py)."""
        self.waits_for_upstream = False
        if self.finish_reason is not None:
            return Step.DONE
        self.win.beat()
        changed = False
        if self.role.downstream is not None:
            done, changed = self._sync_downstream()
            if done:
                self.finish_reason = "done"
                return Step.DONE
        if self.sender is not None:
            changed |= self._send_owed()
        if self.method != "ar":
            changed |= self._take_proposals()
        if self.role.is_last and self._capped:
            self.finish_reason = "eos" if self.out[-1] == self.eos else "length"
            return Step.DONE
        d = self._decide(joining)
        self.want, self.idle = d.want, d.idle
        self.waits_for_upstream = d.chosen
        t = self.clock.now()
        self.recheck_at = self.policy.recheck_at(d, t) if d.chosen else None
        if d.act in (Act.DRAFT, Act.OWN, Act.VERIFY):
            self._wait_ends(t)
            proposal = self.inbox.tokens[: d.n] if d.act is Act.VERIFY else []
            return Forward(d.act, self._full(), list(proposal))
        acted = False
        if d.act is Act.LOOKUP:
            acted = self._lookup(d.n)
            self.idle = not acted
        if not acted:
            changed |= self._publish_flags()
            self.trace.wait_from(t)
            return Step.PROGRESS if changed else Step.WAITING
        self._wait_ends(t)
        return self._acted()

    def rung(self) -> bool:
        """After a WAITING iteration: only a neighbour's publish or proposal (or ``recheck_at``)
        can move this stage, not a send buffer coming free for tokens still owed."""
        return not self.outbox.owes(len(self.out))

    def complete(self, fwd: Forward, checked: Checked, t0: float) -> Step:
        """Finish the iteration ``advance`` stopped at, with the answer to its ``question`` and
        the time its forward started."""
        if fwd.act is Act.VERIFY:
            self._verify(fwd.proposal, checked, t0)
        else:
            self._step("draft" if fwd.act is Act.DRAFT else "own", checked, t0)
        return self._acted()

    def _acted(self) -> Step:
        self._publish()
        if self.sender is not None:
            self._send_owed()
        return Step.ACTED

    def _decide(self, joining: bool = False) -> Decision:
        down = self.down
        v = View(
            method=self.method, first=self.role.upstream is None, last=self.role.is_last,
            lookup=not self.is_scorer, committed=len(self.out), capped=self._capped,
            down_committed=down.length if down else 0, down_want=down.want if down else 0,
            pending=len(self.inbox.tokens), want=self.want, upstream_free=self.role.upstream_free,
            joining=joining, waiting=self.trace.wait_t0 is not None,
        )  # fmt: skip
        return self.policy.decide(v, self._upstream_idle)

    # ------------------------------------------------------------------ actions
    def _step(self, kind: str, checked: Checked, t0: float) -> None:
        """One token of our own (draft step of the first stage, or a verifier's own step)."""
        n0 = len(self.out)
        t1 = self.clock.now()
        self.stats.stepped(kind)
        if self.method != "ar":  # AR's forwards run on other threads (host/placement.py
            self.policy.observe(Forwarded(0, t1 - t0, t1))  # CpuShare.solo): not the policy's costs
        self._commit([checked.verdict.next_token], t1 - t0, checked.dists or [None])
        self.model.truncate(len(self.prompt) + len(self.out) - 1)
        if kind == "own" and not self.inbox.advance(self.out, n0):
            self._bump_epoch()
        self.trace.busy(t0, t1, kind, 1, len(self.prompt) + len(self.out))

    def _lookup(self, limit: int) -> bool:
        t0 = self.clock.now()
        toks = self.model.propose(self._full(), limit, confirmed=len(self.prompt) + self._confirmed())
        t1 = self.clock.now()
        self.stats.looked_up(t1 - t0, len(toks))
        if not toks:
            return False
        self._commit(toks, t1 - t0, self.verifier.point_masses(toks, self.vocab))
        self.trace.event(t0, t1, "draft", len(toks), len(self.prompt) + len(self.out))
        return True

    def _verify(self, proposal: list[int], checked: Checked, t0: float) -> None:
        n = len(proposal)
        n0 = len(self.out)
        t1 = self.clock.now()
        verdict = checked.verdict
        self.stats.verified(n, verdict.n_accepted)
        self.policy.observe(Judged(n, verdict.n_accepted))
        self.policy.observe(Forwarded(n, t1 - t0, t1))
        self._commit(verdict.committed(proposal), t1 - t0, checked.dists)
        self.model.truncate(len(self.prompt) + len(self.out) - 1)
        if verdict.rejected or not self.inbox.advance(self.out, n0):
            self._bump_epoch()
        self.trace.busy(t0, t1, "verify", n, len(self.prompt) + len(self.out))

    def _commit(self, tokens: list[int], cost_s: float, dists: Sequence | None) -> None:
        if self.eos in tokens:
            tokens = tokens[: tokens.index(self.eos) + 1]
        tokens = tokens[: self.limit - len(self.out)]
        if self.sender is not None and self.verifier.carries_dists:
            self.outbox.hold(len(self.out), dists, len(tokens))
        self.ledger.committed(len(self.out), self.down.length if self.down else 0, len(tokens), cost_s)
        self.out.extend(tokens)
        self.stats.committed(len(tokens), len(self.out))
        if self.role.is_last:
            self.trace.committed(self.clock.now(), len(self.out))

    # ------------------------------------------------------------------ neighbours
    def _sync_downstream(self) -> tuple[bool, bool]:
        """Apply the downstream's rollback epoch or catch up with it: (done, changed)."""
        down = self.role.downstream
        h = self._read(self.win.header, down)
        if h.prompt != self.seq:
            return h.prompt > self.seq, False  # finished this prompt and moved on / not started
        self.down = h
        if h.done:
            return True, False
        if h.epoch == self.seen_down_epoch and h.length <= len(self.out):
            self._fates(self.ledger.judged(len(self.out), h.length))
            return False, False
        h, theirs = self._read(self.win.snapshot, down)
        if h.prompt != self.seq:  # it finished and started the next prompt between the two reads
            return h.prompt > self.seq, False
        self.down = h
        if h.done:
            return True, False
        self._adopt(h, theirs)
        return False, True

    def _adopt(self, h: Header, theirs: Sequence[int]) -> None:
        """Take in the downstream's committed tokens ``theirs`` (its header ``h``): ours rolled
        back where they differ, the fates of ours judged, the KV cache cut, what is owed
        downstream rewound, our upstream rolled back where our tokens changed under its
        proposals; then published."""
        epoch_changed = h.epoch != self.seen_down_epoch
        old = len(self.out)
        if epoch_changed and not self.verifier.resendable:
            a = adopt_sent_once(self.out, theirs, self.outbox.sent)
        else:
            a = adopt(self.out, theirs)
        self._fates(self.ledger.judged(a.keep, min(h.length, a.keep), thrown_to=old))
        self.stats.adopted(a.keep, old, len(a.tokens), self.ledger.adopted(a.keep, len(a.tokens)))
        self.out = a.tokens
        self.dirty_from = min(self.dirty_from, a.keep)
        # an idle flag said "nothing more for the tokens as they were": they changed, so it is
        # published cleared until this stage decides again (in this same iteration)
        self.idle = False
        if self.is_scorer:
            self.model.truncate(len(self.prompt) + min(a.keep, len(self.out) - 1))
        if epoch_changed:
            self.seen_down_epoch = h.epoch
        self.outbox.adopted(len(theirs), len(self.out), epoch_changed, discarded=old > a.keep)
        if self.role.upstream is not None and (old > a.keep or not self.inbox.advance(self.out, old)):
            self._bump_epoch()
        self._publish()

    def _send_owed(self) -> bool:
        """Send the tokens the downstream has not got; False when there are none (or no buffer)."""
        carries = self.verifier.carries_dists
        return self.outbox.send(self.out, self.seq, self.seen_down_epoch, carries, self.stats)

    def _take_proposals(self) -> bool:
        msgs, dropped = self.mailbox.take(self.seq)
        self.stats.dropped(dropped)
        before = len(self.inbox.tokens)
        for msg in msgs:
            if msg.epoch != self.epoch:
                self.stats.dropped()
                continue
            rows = None if msg.dists is None else list(msg.dists)
            if not self.inbox.merge(self.out, msg.start, msg.tokens, rows):
                self._bump_epoch()
                self._publish()
                before = 0
        self.policy.observe(Arrived(len(self.inbox.tokens) - before))
        return bool(msgs)

    def _upstream_idle(self) -> bool:
        """The upstream (if any) says idle about our tokens as they are now (its header names the
        epoch and length of ours it had read): a flag about older tokens says nothing (docs/protocol.md)."""
        if self.role.upstream is None:
            return False
        h = self._read(self.win.header, self.role.upstream)
        return (
            h.prompt == self.seq and h.idle and h.down_epoch == self.epoch and h.down_length >= len(self.out)
        )

    def _fates(self, fates: list[tuple[int, bool]]) -> None:
        """The policy learns which of its run-ahead the downstream kept (stage/ledger.py)."""
        for distance, kept in fates:
            self.policy.observe(Fate(distance, kept))

    def _read(self, read, rank: int):
        t0 = self.clock.now()
        out = read(rank)
        self.stats.read(self.clock.now() - t0)
        return out

    # ------------------------------------------------------------------ own state
    def _bump_epoch(self) -> None:
        """Tell the upstream stage to roll back to our committed tokens."""
        self.inbox.clear()
        self.epoch += 1
        self.stats.signalled_rollback()
        self.policy.observe(Restarted())

    @property
    def _capped(self) -> bool:
        return len(self.out) >= self.limit or (bool(self.out) and self.out[-1] == self.eos)

    def _confirmed(self) -> int:
        """How many of our tokens the downstream has committed, as last read (the last stage:
        all of them)."""
        if self.role.downstream is None:
            return len(self.out)
        return min(len(self.out), self.down.length) if self.down is not None else 0

    def _full(self) -> list[int]:
        return self.prompt + self.out

    def _flags(self) -> tuple[int, bool, int, int]:
        """What a header says beside the tokens: the SD demand, the idle flag and the downstream
        version they were decided on."""
        down = self.down  # None until a downstream was read (always, for the last stage)
        return (self.want, self.idle, down.epoch if down else 0, down.length if down else 0)

    def _publish(self, done: bool = False) -> None:
        want, idle, down_epoch, down_length = flags = self._flags()
        header = Header(self.seq, self.epoch, len(self.out), done, want, idle, down_epoch, down_length)
        self.win.publish(header, self.out, self.dirty_from)
        self.dirty_from = len(self.out)
        self.published = flags

    def _publish_flags(self) -> bool:
        """Publish the header if its flags changed (the tokens have not): an idle flag is
        republished when the downstream moved on, so that it says it is about the new tokens."""
        if self.published == self._flags():
            return False
        self._publish()
        return True

    def _wait_ends(self, t: float) -> None:
        self.trace.wait_ends(t, len(self.prompt) + len(self.out))
