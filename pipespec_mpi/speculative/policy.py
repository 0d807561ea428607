"""What a stage does next: a pure function of what it sees and its decode settings.

  first stage (drafter)   a draft step (model) or a lookup of up to ``room`` tokens, within its
                          room: ``max_run_ahead`` beyond its downstream's committed length
                          (PipeSpec), or up to its downstream's demand ``want`` (SD)
  verifier, pipespec      verify min(pending, limit) proposals once ``lookahead`` are pending;
                          with lookahead 0 and nothing pending, a one-token step of its own,
                          unless the upstream is a model-free drafter that is still working and
                          ``wait_for_drafter`` is set: its answer takes microseconds, an own step
                          a forward, so it waits until the drafter proposes or says it has nothing
  verifier, sd            wait for its drafter's full window (published as ``want``), then verify
  either verifier         when the upstream can give no more (``upstream_idle``): verify what is
                          pending, else step on its own
  ar                      the last stage steps alone
  adaptive (decode.policy) PipeSpec's verifiers choose verify-k / wait / own step by expected
                          tokens per second (speculative/goodput.py); with decode.draft_survival
                          set, a model drafter stops where its tokens are more likely thrown away
                          than kept and says it is idle, so that no verifier waits for it. The
                          fixed settings stay as bounds. A slot of a batched stage whose other
                          slots' forward runs now (``joining``) does not wait: it joins that
                          forward (stage/batch.py says why)
A verifier commits up to n + 1 tokens for n verified: the last stage keeps that within
``max_new_tokens``, the others may overshoot their room by the bonus token.

``Policy`` is the port the stage loop decides through (``make_policy``): ``StaticPolicy`` applies
``decide`` as it is, ``AdaptivePolicy`` hands it running estimates and learns from what the loop
observes (forwards, verdicts, arrivals, the fates of drafted tokens).
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from pipespec_mpi.config import DecodeConfig
from pipespec_mpi.speculative.goodput import Estimates, choose, draft_reach, survivals


class Act(enum.Enum):
    WAIT = "wait"
    DRAFT = "draft"  # one token of a model drafter
    LOOKUP = "lookup"  # up to n tokens of a model-free drafter
    VERIFY = "verify"  # n pending proposals in one forward
    OWN = "own"  # a verifier's one-token step of its own


@dataclass(frozen=True)
class View:
    """A stage's situation at a decision (the downstream's values as last read)."""

    method: str  # ar | sd | pipespec
    first: bool  # no upstream: a drafter
    last: bool  # no downstream: its output is the answer
    lookup: bool  # a model-free drafter
    committed: int  # tokens this stage has committed
    capped: bool  # max_new_tokens reached, or the last token is EOS
    down_committed: int = 0  # the downstream's committed length
    down_want: int = 0  # SD: the position up to which the downstream wants proposals
    pending: int = 0  # proposals in the inbox
    want: int = 0  # SD: this stage's current demand
    upstream_idle: bool = False  # the upstream can give no more now (capped, or no lookup hit)
    upstream_free: bool = False  # the upstream is a model-free drafter (its proposals cost ~nothing)
    joining: bool = False  # a batched forward of this stage's other slots runs now (stage/batch.py)
    estimates: Estimates | None = None  # adaptive policy: this stage's running estimates
    now: float = 0.0  # the stage's clock (adaptive: how long its upstream has been silent)


@dataclass(frozen=True)
class Decision:
    act: Act
    n: int = 0  # VERIFY: proposals to verify; LOOKUP: most tokens to propose
    want: int = 0  # SD demand to publish (unchanged unless the decision sets it)
    idle: bool = False  # nothing more to offer downstream now (a lookup miss is known only after it)
    upstream_matters: bool = False  # WAIT that an idle upstream would turn into work
    joined: bool = False  # adaptive: a wait given up to join the stage's batched forward (``joining``)
    # adaptive WAIT: when this wait stops paying although nothing the stage reads changes (the
    # stage's clock; None: not before something changes): a stage asleep on its doorbell, or in
    # the simulator, decides again then
    until: float | None = None


def room(v: View, cfg: DecodeConfig) -> int:
    """How many more tokens the stage may commit now (run-ahead bound or SD demand)."""
    left = cfg.max_new_tokens - v.committed
    if v.last:
        return left
    if v.method == "sd":
        return min(left, max(0, v.down_want - v.committed))
    return min(left, cfg.max_run_ahead - (v.committed - v.down_committed))


def adaptive(v: View, cfg: DecodeConfig) -> bool:
    return cfg.policy == "adaptive" and v.method == "pipespec" and v.estimates is not None


def survival_room(v: View, cfg: DecodeConfig) -> int:
    """Adaptive: how many more tokens a model drafter drafts before its tokens would more likely be
    thrown away than kept (goodput.draft_reach); unbounded for the last stage, a static one and a
    model-free drafter (its drafts cost microseconds, and it cuts its own by survival; holding it
    back slowed PipeSpec: docs/notebook.md, "Measurements behind the code's choices")."""
    if v.last or v.lookup or not adaptive(v, cfg) or cfg.draft_survival <= 0:
        return cfg.max_new_tokens
    reach = draft_reach(v.estimates.survival, cfg.draft_survival, cfg.max_run_ahead)
    return reach - (v.committed - v.down_committed)


def answer_due(v: View, est: Estimates) -> bool:
    """Adaptive, nothing pending: a model-free upstream has not yet answered our tokens as they
    are (a proposal, or its idle flag about them), and the wait for it is still shorter than an
    own step. Its answer takes a loop iteration (the time it takes to notice our new tokens), an
    own step a whole forward, and a proposal is verified for little more than an own step's cost,
    so the delivery rates ``choose`` weighs (g, g_w: tokens per second while this stage computes
    or waits) do not describe it: such a drafter proposes once per token of ours, whatever the
    rate. Without this wait a verifier often stepped on its own just before the proposal for the
    same position arrived (docs/notebook.md, "Measurements behind the code's choices")."""
    if v.pending or not v.upstream_free or v.upstream_idle or v.joining:
        return False
    return not est.waited_an_own_step(v.now)


def decide(v: View, cfg: DecodeConfig) -> Decision:
    """The next action. A verifier's wait can depend on ``upstream_idle``: the caller reads the
    upstream only when the decision says ``upstream_matters``, then decides again."""
    if v.capped:
        return Decision(Act.WAIT, want=v.want, idle=True)
    r = room(v, cfg)
    if r <= 0:  # held by the bound or the demand: not starved, so not idle
        return Decision(Act.WAIT, want=v.want)
    if v.method == "ar":
        return Decision(Act.OWN)
    held = survival_room(v, cfg)
    if held <= 0:  # held by its own choice: idle, so that no verifier waits for it
        return Decision(Act.WAIT, want=v.want, idle=True)
    r = min(r, held)
    if v.first:
        return Decision(Act.LOOKUP, n=r) if v.lookup else Decision(Act.DRAFT)
    budget = r if v.last else cfg.max_new_tokens - v.committed
    limit = min(cfg.max_verify, budget - 1)  # room for the bonus token
    want = v.want
    if v.method == "sd":
        window = min(cfg.window("sd"), limit)
        want = v.committed + window
        if window <= 0:
            return Decision(Act.OWN, want=want)
        if v.pending >= window:
            return Decision(Act.VERIFY, n=window, want=want)
    elif adaptive(v, cfg):
        if limit < 1:
            return Decision(Act.OWN)
        est = v.estimates
        if answer_due(v, est):
            return Decision(Act.WAIT, upstream_matters=True, until=est.answer_deadline())
        accept, costs, gap, wait_gap = est.acceptance(), est.costs(limit), est.gap(), est.wait_gap(v.now)
        most_wait = 0 if v.upstream_idle else min(limit, cfg.max_run_ahead)
        c = choose(accept, costs, v.pending, limit, most_wait, gap, wait_gap)
        joined = v.joining and c.act == "wait"
        if joined:  # the wait yields to the batched forward running now: the best other action
            c = choose(accept, costs, v.pending, limit, 0, gap, wait_gap)
        if c.act == "verify":
            return Decision(Act.VERIFY, n=c.n, joined=joined)
        if c.act == "own":
            return Decision(Act.OWN, joined=joined)
        return Decision(Act.WAIT, upstream_matters=True)
    else:
        need = max(1, min(cfg.lookahead, limit))
        if v.pending >= need and limit >= 1:
            return Decision(Act.VERIFY, n=min(v.pending, limit))
        if cfg.lookahead == 0 and not (v.upstream_free and cfg.wait_for_drafter):
            return Decision(Act.OWN)
    if v.upstream_idle:  # the upstream cannot give us more: work on what we have
        if v.pending and limit >= 1:
            return Decision(Act.VERIFY, n=min(v.pending, limit), want=want)
        return Decision(Act.OWN, want=want)
    return Decision(Act.WAIT, want=want, upstream_matters=True)


class ChoiceCounts(Protocol):
    """The counters of a stage's choices (stage/stats.py StageStats)."""

    waits_chosen: int
    waits_joined: int
    verify_cut: int
    drafts_held: int


class Policy(Protocol):
    """The port a stage loop decides through: ``decide`` under the settings ``cfg``, the
    observations a policy learns from, and when a chosen wait should be reconsidered."""

    cfg: DecodeConfig
    shares_rows: bool  # a batched stage's slots share its verification rows by survival (stage/batch.py)

    def with_config(self, cfg: DecodeConfig) -> Policy:
        """The same policy, what it learned kept, under other settings (a batched phase's)."""
        ...

    def decide(self, v: View, upstream_idle: Callable[[], bool]) -> Decision:
        """The next action; ``upstream_idle`` is read only when the decision depends on it."""
        ...

    def waits_by_choice(self, d: Decision) -> bool:
        """Whether ``d`` is a wait this policy chose although it could act."""
        ...

    def recheck_at(self, d: Decision, now: float) -> float | None:
        """When a wait of its choice stops paying with nothing changed (None: on change only)."""
        ...

    # what the loop reports: a decision it took (counted in ``stats`` where the policy chose it);
    # a forward of k proposal rows (0: a one-token step) taking ``seconds``, ending at ``end``; a
    # verdict; proposal tokens arriving; a rollback it asked for; a drafted token ``distance``
    # ahead of the downstream kept or thrown away
    def observe_choice(self, v: View, d: Decision, stats: ChoiceCounts, starts_wait: bool) -> None: ...
    def forward(self, k: int, seconds: float, end: float) -> None: ...
    def verified(self, n: int, accepted: int) -> None: ...
    def arrived(self, n_tokens: int) -> None: ...
    def restarted(self) -> None: ...
    def fate(self, distance: int, kept: bool) -> None: ...

    def survivals(self, n: int) -> list[float]:
        """The chance that each of ``n`` pending proposals is still standing after its verification."""
        ...

    def snapshot(self) -> dict:
        """What it has learned, for the stage's record (``policy_state``)."""
        ...


class StaticPolicy:
    """The paper's rule: the fixed lookahead and bounds of ``cfg``; it learns nothing."""

    shares_rows = False

    def __init__(self, cfg: DecodeConfig) -> None:
        self.cfg = cfg

    def with_config(self, cfg: DecodeConfig) -> Policy:
        other = copy.copy(self)
        other.cfg = cfg
        return other

    def decide(self, v: View, upstream_idle: Callable[[], bool]) -> Decision:
        d = decide(v, self.cfg)
        if d.upstream_matters and upstream_idle():
            d = decide(replace(v, upstream_idle=True), self.cfg)
        return d

    def waits_by_choice(self, d: Decision) -> bool:
        return False

    def recheck_at(self, d: Decision, now: float) -> float | None:
        return None

    def observe_choice(self, v: View, d: Decision, stats: ChoiceCounts, starts_wait: bool) -> None:
        pass

    def forward(self, k: int, seconds: float, end: float) -> None:
        pass

    def verified(self, n: int, accepted: int) -> None:
        pass

    def arrived(self, n_tokens: int) -> None:
        pass

    def restarted(self) -> None:
        pass

    def fate(self, distance: int, kept: bool) -> None:
        pass

    def survivals(self, n: int) -> list[float]:
        return [1.0] * n

    def snapshot(self) -> dict:
        return {}


class AdaptivePolicy(StaticPolicy):
    """Decisions by expected tokens per second from running estimates (speculative/goodput.py),
    kept across prompts and phases; it reads the stage's clock where it learns or decides."""

    shares_rows = True

    def __init__(
        self, cfg: DecodeConfig, now: Callable[[], float], estimates: Estimates | None = None
    ) -> None:
        super().__init__(cfg)
        self.now = now  # the stage's clock
        self.est = estimates if estimates is not None else Estimates(cfg.accept_prior, cfg.estimate_rate)

    def decide(self, v: View, upstream_idle: Callable[[], bool]) -> Decision:
        return super().decide(replace(v, estimates=self.est, now=self.now()), upstream_idle)

    def waits_by_choice(self, d: Decision) -> bool:
        return d.act is Act.WAIT and d.upstream_matters

    def recheck_at(self, d: Decision, now: float) -> float | None:
        g = self.est.expected_wait_gap()  # the next proposal is due then
        due = [x for x in (None if g is None else now + max(g, 1e-4), d.until) if x is not None]
        return min(due, default=None)

    def observe_choice(self, v: View, d: Decision, stats: ChoiceCounts, starts_wait: bool) -> None:
        """What it chose where the static rule would have acted at once (a wait counts once, when
        it starts)."""
        if d.joined:
            stats.waits_joined += 1
        if d.act is Act.VERIFY and d.n < v.pending:
            stats.verify_cut += 1
        elif d.act is Act.WAIT and starts_wait:
            if d.idle and not v.capped:
                stats.drafts_held += 1
            elif d.upstream_matters:
                stats.waits_chosen += 1

    def forward(self, k: int, seconds: float, end: float) -> None:
        self.est.forward(k, seconds, end)

    def verified(self, n: int, accepted: int) -> None:
        self.est.verified(n, accepted)

    def arrived(self, n_tokens: int) -> None:
        self.est.arrived(self.now(), n_tokens)

    def restarted(self) -> None:
        self.est.restarted(self.now())

    def fate(self, distance: int, kept: bool) -> None:
        self.est.fate(distance, kept)

    def survivals(self, n: int) -> list[float]:
        return survivals(self.est.acceptance(), n)

    def snapshot(self) -> dict:
        return self.est.snapshot()


def make_policy(cfg: DecodeConfig, now: Callable[[], float], estimates: Estimates | None = None) -> Policy:
    """``decode.policy``'s implementation on the stage's clock ``now``; ``estimates``: the
    adaptive policy's own (the explorer's drawn ones)."""
    if cfg.policy == "adaptive" or estimates is not None:
        return AdaptivePolicy(cfg, now, estimates)
    return StaticPolicy(cfg)
