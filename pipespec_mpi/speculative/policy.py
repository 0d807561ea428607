"""What a stage does next: pure rules of what it sees and its decode settings, one per policy.

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

``paper_rule`` and ``adaptive_rule`` are the rules; ``Policy`` is the port the stage loop decides
through (``make_policy``): ``StaticPolicy`` applies the paper's rule, ``AdaptivePolicy`` its own
on running estimates that learn from what the loop observes (``Observation``), and counts the
choices it made where the paper's rule would have acted (``ChoiceCounts``, into the records).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Protocol

from pipespec_mpi.config import DecodeConfig
from pipespec_mpi.config.schema import Policy as PolicyName
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
    waiting: bool = False  # the stage's last iteration waited (a wait that goes on is one wait)


@dataclass(frozen=True)
class Decision:
    act: Act
    n: int = 0  # VERIFY: proposals to verify; LOOKUP: most tokens to propose
    want: int = 0  # SD demand to publish (unchanged unless the decision sets it)
    idle: bool = False  # nothing more to offer downstream now (a lookup miss is known only after it)
    upstream_matters: bool = False  # WAIT that an idle upstream would turn into work
    chosen: bool = False  # a wait for more proposals the policy chose although it could act
    joined: bool = False  # adaptive: a wait given up to join the stage's batched forward (``joining``)
    # adaptive WAIT: when this wait stops paying although nothing the stage reads changes (the
    # stage's clock; None: not before something changes): a stage asleep on its doorbell, or in
    # the simulator, decides again then
    until: float | None = None


# ---------------------------------------------------------------------- what every rule shares
def room(v: View, cfg: DecodeConfig) -> int:
    """How many more tokens the stage may commit now (run-ahead bound or SD demand)."""
    left = cfg.max_new_tokens - v.committed
    if v.last:
        return left
    if v.method == "sd":
        return min(left, max(0, v.down_want - v.committed))
    return min(left, cfg.max_run_ahead - (v.committed - v.down_committed))


def held_back(v: View, cfg: DecodeConfig) -> Decision | None:
    """What every rule decides first: a capped stage or one held by its room waits, AR's stage
    steps (None: the rule goes on)."""
    if v.capped:
        return Decision(Act.WAIT, want=v.want, idle=True)
    if room(v, cfg) <= 0:  # held by the bound or the demand: not starved, so not idle
        return Decision(Act.WAIT, want=v.want)
    if v.method == "ar":
        return Decision(Act.OWN)
    return None


def drafting(v: View, cfg: DecodeConfig, held: int) -> Decision | None:
    """Then: a stage that holds by its own choice (``held`` <= 0 more tokens) waits, idle, so
    that no verifier waits for it; a drafter drafts, or looks up within its room and ``held``.
    None: a verifier, whose choice is its rule's."""
    if held <= 0:
        return Decision(Act.WAIT, want=v.want, idle=True)
    if v.first:
        return Decision(Act.LOOKUP, n=min(room(v, cfg), held)) if v.lookup else Decision(Act.DRAFT)
    return None


def verify_limit(v: View, cfg: DecodeConfig) -> int:
    """The most proposals a verifier may take in one forward: max_verify, within its room (the
    last stage) or its budget, less one for the bonus token."""
    budget = room(v, cfg) if v.last else cfg.max_new_tokens - v.committed
    return min(cfg.max_verify, budget - 1)


def sd_rule(v: View, cfg: DecodeConfig, limit: int) -> Decision:
    """SD's verifier under either policy: wait for the drafter's full window, then verify it."""
    window = min(cfg.window("sd"), limit)
    want = v.committed + window
    if window <= 0:
        return Decision(Act.OWN, want=want)
    if v.pending >= window:
        return Decision(Act.VERIFY, n=window, want=want)
    return unless_idle(v, limit, want)


def unless_idle(v: View, limit: int, want: int) -> Decision:
    """A verifier that would wait: when its upstream can give no more, it works on what it has."""
    if v.upstream_idle:
        if v.pending and limit >= 1:
            return Decision(Act.VERIFY, n=min(v.pending, limit), want=want)
        return Decision(Act.OWN, want=want)
    return Decision(Act.WAIT, want=want, upstream_matters=True)


# ---------------------------------------------------------------------- the rules
def paper_rule(v: View, cfg: DecodeConfig) -> Decision:
    """The paper's rule: the fixed lookahead and bounds of ``cfg`` (the upstream read only when
    the decision says ``upstream_matters``: the caller then decides again)."""
    d = held_back(v, cfg) or drafting(v, cfg, cfg.max_new_tokens)
    if d is not None:
        return d
    limit = verify_limit(v, cfg)
    if v.method == "sd":
        return sd_rule(v, cfg, limit)
    need = max(1, min(cfg.lookahead, limit))
    if v.pending >= need and limit >= 1:
        return Decision(Act.VERIFY, n=min(v.pending, limit))
    if cfg.lookahead == 0 and not (v.upstream_free and cfg.wait_for_drafter):
        return Decision(Act.OWN)
    return unless_idle(v, limit, v.want)


def survival_room(v: View, cfg: DecodeConfig, est: Estimates) -> int:
    """Adaptive: how many more tokens a model drafter drafts before its tokens would more likely be
    thrown away than kept (goodput.draft_reach); unbounded for the last stage and a model-free
    drafter (its drafts cost microseconds, and it cuts its own by survival; holding it back
    slowed PipeSpec: docs/notebook.md, "Measurements behind the code's choices")."""
    if v.last or v.lookup or cfg.draft_survival <= 0:
        return cfg.max_new_tokens
    reach = draft_reach(est.survival, cfg.draft_survival, cfg.max_run_ahead)
    return reach - (v.committed - v.down_committed)


def answer_due(v: View, est: Estimates, now: float) -> bool:
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
    return not est.waited_an_own_step(now)


def adaptive_rule(v: View, cfg: DecodeConfig, est: Estimates, now: float) -> Decision:
    """PipeSpec's stages by expected tokens per second from ``est`` at the stage's clock ``now``
    (speculative/goodput.py); SD and AR by the paper's rule."""
    if v.method != "pipespec":
        return paper_rule(v, cfg)
    d = held_back(v, cfg) or drafting(v, cfg, survival_room(v, cfg, est))
    if d is not None:
        return d
    limit = verify_limit(v, cfg)
    if limit < 1:
        return Decision(Act.OWN)
    if answer_due(v, est, now):
        return Decision(Act.WAIT, upstream_matters=True, until=est.answer_deadline())
    accept, costs, gap, wait_gap = est.acceptance(), est.costs(limit), est.gap(), est.wait_gap(now)
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


# ---------------------------------------------------------------------- what a policy learns from
@dataclass(frozen=True)
class Forwarded:
    """A forward of ``k`` proposal rows (0: a one-token step) that took ``seconds``, ending at ``end``."""

    k: int
    seconds: float
    end: float


@dataclass(frozen=True)
class Judged:
    """A verification of ``n`` proposals, ``accepted`` of them kept."""

    n: int
    accepted: int


@dataclass(frozen=True)
class Arrived:
    """``tokens`` proposals taken into the inbox (0: a message that added none)."""

    tokens: int


@dataclass(frozen=True)
class Restarted:
    """This stage asked its upstream to roll back (its proposals start again)."""


@dataclass(frozen=True)
class Fate:
    """A token drafted ``distance`` ahead of the downstream, ``kept`` or thrown away by it."""

    distance: int
    kept: bool


@dataclass(frozen=True)
class Cut:
    """A batched stage verified fewer of this slot's proposals than were pending (stage/batch.py)."""


Observation = Forwarded | Judged | Arrived | Restarted | Fate | Cut


@dataclass
class ChoiceCounts:
    """Choices a policy made where the paper's rule would have acted at once (one prompt's: the
    records' waits_chosen, waits_joined, verify_cut, drafts_held)."""

    waits_chosen: int = 0  # waits for more proposals although it could act (a wait counts once)
    waits_joined: int = 0  # such waits given up to join the stage's batched forward
    verify_cut: int = 0  # verifications of fewer proposals than were pending
    drafts_held: int = 0  # a model drafter's holds by survival

    def take(self) -> ChoiceCounts:
        """These counts, and zero from now on."""
        out = replace(self)
        for f in fields(self):
            setattr(self, f.name, 0)
        return out


# ---------------------------------------------------------------------- the port
class Policy(Protocol):
    """The port a stage loop decides through: ``decide`` under the settings ``cfg``, when a wait
    of its choice should be reconsidered, and what it learns from (``observe``)."""

    cfg: DecodeConfig
    shares_rows: bool  # a batched stage's slots share its verification rows by survival (stage/batch.py)

    def for_phase(self, cfg: DecodeConfig) -> Policy:
        """A policy for a phase under ``cfg`` (a batched phase's settings), what this one learned kept."""
        ...

    def decide(self, v: View, upstream_idle: Callable[[], bool]) -> Decision:
        """The next action; ``upstream_idle`` is read only when the decision depends on it."""
        ...

    def decide_again_at(self, d: Decision, now: float) -> float | None:
        """When a wait of its choice (``d.chosen``) stops paying with nothing changed (None: on
        change only)."""
        ...

    def observe(self, o: Observation) -> None:
        """What the loop saw happen."""
        ...

    def survivals(self, n: int) -> list[float]:
        """The chance that each of ``n`` pending proposals is still standing after its verification."""
        ...

    def report(self) -> tuple[ChoiceCounts, dict]:
        """Its choices since the last report and what it has learned (a prompt's record)."""
        ...


class StaticPolicy:
    """The paper's rule (``paper_rule``) under ``cfg``; it learns nothing and chooses no waits."""

    shares_rows = False

    def __init__(self, cfg: DecodeConfig) -> None:
        self.cfg = cfg

    def for_phase(self, cfg: DecodeConfig) -> Policy:
        return StaticPolicy(cfg)

    def decide(self, v: View, upstream_idle: Callable[[], bool]) -> Decision:
        d = paper_rule(v, self.cfg)
        if d.upstream_matters and upstream_idle():
            d = paper_rule(replace(v, upstream_idle=True), self.cfg)
        return d

    def decide_again_at(self, d: Decision, now: float) -> float | None:
        return None

    def observe(self, o: Observation) -> None:
        pass

    def survivals(self, n: int) -> list[float]:
        return [1.0] * n

    def report(self) -> tuple[ChoiceCounts, dict]:
        return ChoiceCounts(), {}


class AdaptivePolicy:
    """``adaptive_rule`` on running estimates (speculative/goodput.py), kept across prompts and
    phases; it reads the stage's clock where it learns or decides, and counts its own choices."""

    shares_rows = True

    def __init__(
        self, cfg: DecodeConfig, now: Callable[[], float], estimates: Estimates | None = None
    ) -> None:
        self.cfg = cfg
        self.now = now  # the stage's clock
        self.est = estimates if estimates is not None else Estimates(cfg.accept_prior, cfg.estimate_rate)
        self.counts = ChoiceCounts()

    def for_phase(self, cfg: DecodeConfig) -> Policy:
        return AdaptivePolicy(cfg, self.now, self.est)

    def decide(self, v: View, upstream_idle: Callable[[], bool]) -> Decision:
        now = self.now()
        d = adaptive_rule(v, self.cfg, self.est, now)
        if d.upstream_matters and upstream_idle():
            d = adaptive_rule(replace(v, upstream_idle=True), self.cfg, self.est, now)
        if d.act is Act.WAIT and d.upstream_matters:
            d = replace(d, chosen=True)
        self._count(v, d)
        return d

    def _count(self, v: View, d: Decision) -> None:
        """What it chose where the paper's rule would have acted at once (a wait counts once, when
        it starts)."""
        c = self.counts
        if d.joined:
            c.waits_joined += 1
        if d.act is Act.VERIFY and d.n < v.pending:
            c.verify_cut += 1
        elif d.act is Act.WAIT and not v.waiting:
            if d.idle and not v.capped:
                c.drafts_held += 1
            elif d.upstream_matters:
                c.waits_chosen += 1

    def decide_again_at(self, d: Decision, now: float) -> float | None:
        g = self.est.expected_wait_gap()  # the next proposal is due then
        due = [x for x in (None if g is None else now + max(g, 1e-4), d.until) if x is not None]
        return min(due, default=None)

    def observe(self, o: Observation) -> None:
        match o:
            case Forwarded(k, seconds, end):
                self.est.forward(k, seconds, end)
            case Judged(n, accepted):
                self.est.verified(n, accepted)
            case Arrived(tokens):
                self.est.arrived(self.now(), tokens)
            case Restarted():
                self.est.restarted(self.now())
            case Fate(distance, kept):
                self.est.fate(distance, kept)
            case Cut():
                self.counts.verify_cut += 1

    def survivals(self, n: int) -> list[float]:
        return survivals(self.est.acceptance(), n)

    def report(self) -> tuple[ChoiceCounts, dict]:
        return self.counts.take(), self.est.snapshot()


def make_policy(cfg: DecodeConfig, now: Callable[[], float], estimates: Estimates | None = None) -> Policy:
    """``decode.policy``'s implementation on the stage's clock ``now``; ``estimates``: the
    adaptive policy's own to start from (the explorer's drawn ones)."""
    if PolicyName(cfg.policy).learns:
        return AdaptivePolicy(cfg, now, estimates)
    return StaticPolicy(cfg)
