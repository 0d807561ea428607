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
from pipespec_mpi.speculative.sequence import adopt, adopt_sent_once
from pipespec_mpi.speculative.verifiers import Checked, Question, Verifier, check_all
from pipespec_mpi.stage.mailbox import Mailbox
from pipespec_mpi.stage.outbox import Outbox
from pipespec_mpi.stage.ports import Header, Proposer, Scorer, StagePorts, StageRole
from pipespec_mpi.stage.prompt import On, PromptState, Wait
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
    """One stage decoding prompts one after another: ``reset(seq)`` before the start of a prompt
    (its ``PromptState``, stage/prompt.py: everything the loop changes while decoding it),
    ``begin(...)`` at its start, ``step()`` until DONE (after a WAITING step, ``wait()`` says what
    it waits on), ``finish()``; ``pump()`` while waiting between prompts."""

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
        self.p: PromptState | None = None  # the prompt in hand, from ``reset``
        # a waiting stage's next moment to decide again although nothing it sees changed (a
        # policy's wait stops paying as the upstream stays silent); None: on change only
        self.until: float | None = None
        self.waits_for_upstream = False  # the last iteration waited for more proposals by choice

    @property
    def cfg(self) -> DecodeConfig:
        """The decode settings, the policy's (a phase's: ``enter_phase``)."""
        return self.policy.cfg

    def enter_phase(self, decode: DecodeConfig) -> None:
        """Between prompts: decide under a phase's settings (a batch size's, DecodeConfig.for_batch)
        by a policy made for them from this one, what it learned carried over."""
        if self.p is not None and self.p.finish_reason is None:
            raise RuntimeError(f"stage {self.role.stage}: a phase change with prompt {self.p.seq} in flight")
        self.policy = self.policy.for_phase(decode)

    # ------------------------------------------------------------------ prompt boundaries
    def reset(self, seq: int) -> PromptState:
        """Publish a fresh header for prompt ``seq`` (before the start of the prompt); its state."""
        stats = StageStats(self.role.stage, self.role.rank, getattr(self.model, "name", "?"))
        self.p = PromptState(
            seq, stats, Trace(stats, self.record_timeline), Outbox(self.role.stage, self.sender)
        )
        self._publish()
        return self.p

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
        self.p.prompt, self.p.method, self.p.verifier = list(prompt), method, verifier
        self.p.limit = min(max_new_tokens or self.cfg.max_new_tokens, self.cfg.max_new_tokens)
        t0 = self.clock.now()
        self.p.trace.start(t0)
        if idle or (method == "ar" and not self.role.is_last):  # AR: the last model alone; the others idle
            self.p.finish_reason = "idle"
            return
        # the sequence reaches prompt + max_new_tokens, plus a proposal under verification
        room = self.p.limit + self.cfg.max_verify + 1
        if self.is_scorer:
            self.model.prefill(self.p.prompt, room=room)
        else:  # a drafter's job store (models/suffix.py)
            self.model.prefill(self.p.prompt, room=room, store_key=store_key or method)
        t1 = self.clock.now()
        self.p.stats.prefilled(t1 - t0)
        self.p.trace.event(t0, t1, "prefill", len(self.p.prompt), len(self.p.prompt))

    def finish(self) -> StageOutcome:
        """After DONE: publish ``done`` (relayed upstream) and hand over the outcome."""
        t = self.clock.now()
        self._wait_ends(t)
        if not self.is_scorer and self.p.finish_reason != "idle":
            self.p.stats.drafted(self.model.end_sequence(self.p.out[: self._confirmed()]))
        if self.p.finish_reason != "idle":
            self.p.stats.chose(*self.policy.report())
        self._publish(done=True)
        return StageOutcome(
            list(self.p.out), self.p.finish_reason or "done", t - self.p.trace.t_start, self.p.stats
        )

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
        dists = self.p.inbox.rows[:n] if n and self.p.verifier.carries_dists else None
        return Question(self.p.verifier, fwd.proposal, logits, len(self.p.out), dists)

    def advance(self, joining: bool = False) -> Step | Forward:
        """One iteration up to its forward: a ``Step``, or the ``Forward`` decided on, which the
        driver runs (alone, or batched with other slots' forwards) and hands to ``complete``.
        ``joining``: the stage's other slots forward now, so the policy need not wait for more
        proposals (``waits_for_upstream`` says when an iteration did: stage/batch.py)."""
        self.waits_for_upstream = False
        if self.p.finish_reason is not None:
            return Step.DONE
        self.win.beat()
        changed = False
        if self.role.downstream is not None:
            done, changed = self._sync_downstream()
            if done:
                self.p.finish_reason = "done"
                return Step.DONE
        if self.sender is not None:
            changed |= self._send_owed()
        if self.p.method != "ar":
            changed |= self._take_proposals()
        if self.role.is_last and self._capped:
            self.p.finish_reason = "eos" if self.p.out[-1] == self.eos else "length"
            return Step.DONE
        d = self._decide(joining)
        self.p.want, self.p.idle = d.want, d.idle
        self.waits_for_upstream = d.chosen
        t = self.clock.now()
        self.until = self.policy.decide_again_at(d, t) if d.chosen else None
        if d.act in (Act.DRAFT, Act.OWN, Act.VERIFY):
            self._wait_ends(t)
            proposal = self.p.inbox.tokens[: d.n] if d.act is Act.VERIFY else []
            return Forward(d.act, self.p.full(), list(proposal))
        acted = False
        if d.act is Act.LOOKUP:
            acted = self._lookup(d.n)
            self.p.idle = not acted
        if not acted:
            changed |= self._publish_flags()
            self.p.trace.wait_from(t)
            return Step.PROGRESS if changed else Step.WAITING
        self._wait_ends(t)
        return self._acted()

    def wait(self) -> Wait:
        """After a WAITING iteration: a neighbour's publish or proposal (or the policy's recheck)
        moves this stage, or, with tokens still owed downstream, a send buffer coming free."""
        return Wait(On.OTHER if self.p.outbox.owes(len(self.p.out)) else On.NEIGHBOUR, self.until)

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
        down = self.p.down
        v = View(
            method=self.p.method, first=self.role.upstream is None, last=self.role.is_last,
            lookup=not self.is_scorer, committed=len(self.p.out), capped=self._capped,
            down_committed=down.length if down else 0, down_want=down.want if down else 0,
            pending=len(self.p.inbox.tokens), want=self.p.want, upstream_free=self.role.upstream_free,
            joining=joining, waiting=self.p.trace.wait_t0 is not None,
        )  # fmt: skip
        return self.policy.decide(v, self._upstream_idle)

    # ------------------------------------------------------------------ actions
    def _step(self, kind: str, checked: Checked, t0: float) -> None:
        """One token of our own (draft step of the first stage, or a verifier's own step)."""
        n0 = len(self.p.out)
        t1 = self.clock.now()
        self.p.stats.stepped(kind)
        if self.p.method != "ar":  # AR's forwards run on other threads (host/placement.py
            self.policy.observe(Forwarded(0, t1 - t0, t1))  # CpuShare.solo): not the policy's costs
        self._commit([checked.verdict.next_token], t1 - t0, checked.dists or [None])
        self.model.truncate(len(self.p.prompt) + len(self.p.out) - 1)
        if kind == "own" and not self.p.inbox.advance(self.p.out, n0):
            self._bump_epoch()
        self.p.trace.busy(t0, t1, kind, 1, len(self.p.prompt) + len(self.p.out))

    def _lookup(self, limit: int) -> bool:
        t0 = self.clock.now()
        toks = self.model.propose(self.p.full(), limit, confirmed=len(self.p.prompt) + self._confirmed())
        t1 = self.clock.now()
        self.p.stats.looked_up(t1 - t0, len(toks))
        if not toks:
            return False
        self._commit(toks, t1 - t0, self.p.verifier.point_masses(toks, self.vocab))
        self.p.trace.event(t0, t1, "draft", len(toks), len(self.p.prompt) + len(self.p.out))
        return True

    def _verify(self, proposal: list[int], checked: Checked, t0: float) -> None:
        n = len(proposal)
        n0 = len(self.p.out)
        t1 = self.clock.now()
        verdict = checked.verdict
        self.p.stats.verified(n, verdict.n_accepted)
        self.policy.observe(Judged(n, verdict.n_accepted))
        self.policy.observe(Forwarded(n, t1 - t0, t1))
        self._commit(verdict.committed(proposal), t1 - t0, checked.dists)
        self.model.truncate(len(self.p.prompt) + len(self.p.out) - 1)
        if verdict.rejected or not self.p.inbox.advance(self.p.out, n0):
            self._bump_epoch()
        self.p.trace.busy(t0, t1, "verify", n, len(self.p.prompt) + len(self.p.out))

    def _commit(self, tokens: list[int], cost_s: float, dists: Sequence | None) -> None:
        if self.eos in tokens:
            tokens = tokens[: tokens.index(self.eos) + 1]
        tokens = tokens[: self.p.limit - len(self.p.out)]
        if self.sender is not None and self.p.verifier.carries_dists:
            self.p.outbox.hold(len(self.p.out), dists, len(tokens))
        self.p.ledger.committed(
            len(self.p.out), self.p.down.length if self.p.down else 0, len(tokens), cost_s
        )
        self.p.out.extend(tokens)
        self.p.stats.committed(len(tokens), len(self.p.out))
        if self.role.is_last:
            self.p.trace.committed(self.clock.now(), len(self.p.out))

    # ------------------------------------------------------------------ neighbours
    def _sync_downstream(self) -> tuple[bool, bool]:
        """Apply the downstream's rollback epoch or catch up with it: (done, changed)."""
        down = self.role.downstream
        h = self._read(self.win.header, down)
        if h.prompt != self.p.seq:
            return h.prompt > self.p.seq, False  # finished this prompt and moved on / not started
        self.p.down = h
        if h.done:
            return True, False
        if h.epoch == self.p.seen_down_epoch and h.length <= len(self.p.out):
            self._fates(self.p.ledger.judged(len(self.p.out), h.length))
            return False, False
        h, theirs = self._read(self.win.snapshot, down)
        if h.prompt != self.p.seq:  # it finished and started the next prompt between the two reads
            return h.prompt > self.p.seq, False
        self.p.down = h
        if h.done:
            return True, False
        self._adopt(h, theirs)
        return False, True

    def _adopt(self, h: Header, theirs: Sequence[int]) -> None:
        """Take in the downstream's committed tokens ``theirs`` (its header ``h``): ours rolled
        back where they differ, the fates of ours judged, the KV cache cut, what is owed
        downstream rewound, our upstream rolled back where our tokens changed under its
        proposals; then published."""
        epoch_changed = h.epoch != self.p.seen_down_epoch
        old = len(self.p.out)
        if epoch_changed and not self.p.verifier.resendable:
            a = adopt_sent_once(self.p.out, theirs, self.p.outbox.sent)
        else:
            a = adopt(self.p.out, theirs)
        self._fates(self.p.ledger.judged(a.keep, min(h.length, a.keep), thrown_to=old))
        self.p.stats.adopted(a.keep, old, len(a.tokens), self.p.ledger.adopted(a.keep, len(a.tokens)))
        self.p.out = a.tokens
        self.p.dirty_from = min(self.p.dirty_from, a.keep)
        # an idle flag said "nothing more for the tokens as they were": they changed, so it is
        # published cleared until this stage decides again (in this same iteration)
        self.p.idle = False
        if self.is_scorer:
            self.model.truncate(len(self.p.prompt) + min(a.keep, len(self.p.out) - 1))
        if epoch_changed:
            self.p.seen_down_epoch = h.epoch
        self.p.outbox.adopted(len(theirs), len(self.p.out), epoch_changed, discarded=old > a.keep)
        if self.role.upstream is not None and (old > a.keep or not self.p.inbox.advance(self.p.out, old)):
            self._bump_epoch()
        self._publish()

    def _send_owed(self) -> bool:
        """Send the tokens the downstream has not got; False when there are none (or no buffer)."""
        carries = self.p.verifier.carries_dists
        return self.p.outbox.send(self.p.out, self.p.seq, self.p.seen_down_epoch, carries, self.p.stats)

    def _take_proposals(self) -> bool:
        msgs, dropped = self.mailbox.take(self.p.seq)
        self.p.stats.dropped(dropped)
        before = len(self.p.inbox.tokens)
        for msg in msgs:
            if msg.epoch != self.p.epoch:
                self.p.stats.dropped()
                continue
            rows = None if msg.dists is None else list(msg.dists)
            if not self.p.inbox.merge(self.p.out, msg.start, msg.tokens, rows):
                self._bump_epoch()
                self._publish()
                before = 0
        self.policy.observe(Arrived(len(self.p.inbox.tokens) - before))
        return bool(msgs)

    def _upstream_idle(self) -> bool:
        """The upstream (if any) says idle about our tokens as they are now (its header names the
        epoch and length of ours it had read): a flag about older tokens says nothing (docs/protocol.md)."""
        if self.role.upstream is None:
            return False
        h = self._read(self.win.header, self.role.upstream)
        return (
            h.prompt == self.p.seq
            and h.idle
            and h.down_epoch == self.p.epoch
            and h.down_length >= len(self.p.out)
        )

    def _fates(self, fates: list[tuple[int, bool]]) -> None:
        """The policy learns which of its run-ahead the downstream kept (stage/ledger.py)."""
        for distance, kept in fates:
            self.policy.observe(Fate(distance, kept))

    def _read(self, read, rank: int):
        t0 = self.clock.now()
        out = read(rank)
        self.p.stats.read(self.clock.now() - t0)
        return out

    # ------------------------------------------------------------------ own state
    def _bump_epoch(self) -> None:
        """Tell the upstream stage to roll back to our committed tokens."""
        self.p.inbox.clear()
        self.p.epoch += 1
        self.p.stats.signalled_rollback()
        self.policy.observe(Restarted())

    @property
    def _capped(self) -> bool:
        return len(self.p.out) >= self.p.limit or (bool(self.p.out) and self.p.out[-1] == self.eos)

    def _confirmed(self) -> int:
        """How many of our tokens the downstream has committed, as last read (the last stage:
        all of them)."""
        if self.role.downstream is None:
            return len(self.p.out)
        return min(len(self.p.out), self.p.down.length) if self.p.down is not None else 0

    def _flags(self) -> tuple[int, bool, int, int]:
        """What a header says beside the tokens: the SD demand, the idle flag and the downstream
        version they were decided on."""
        down = self.p.down  # None until a downstream was read (always, for the last stage)
        return (self.p.want, self.p.idle, down.epoch if down else 0, down.length if down else 0)

    def _publish(self, done: bool = False) -> None:
        want, idle, down_epoch, down_length = flags = self._flags()
        header = Header(self.p.seq, self.p.epoch, len(self.p.out), done, want, idle, down_epoch, down_length)
        self.win.publish(header, self.p.out, self.p.dirty_from)
        self.p.dirty_from = len(self.p.out)
        self.p.published = flags

    def _publish_flags(self) -> bool:
        """Publish the header if its flags changed (the tokens have not): an idle flag is
        republished when the downstream moved on, so that it says it is about the new tokens."""
        if self.p.published == self._flags():
            return False
        self._publish()
        return True

    def _wait_ends(self, t: float) -> None:
        self.p.trace.wait_ends(t, len(self.p.prompt) + len(self.p.out))
