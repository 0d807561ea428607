"""The discrete-event simulator: the real stage loop of every stage over simulated ports.

Each stage is a ``StageLoop`` (stage/loop.py) with a simulated clock, an oracle model whose
forwards take the time its ``LatencyProfile`` says, and a window and channels with delays:

  * a proposal reaches the next stage ``latency`` seconds after it is sent, and a header change
    is seen by a neighbour ``latency`` seconds after it is published (the transport plus the
    neighbour's polling delay), per pair and direction;
  * with ``blocking_reads`` a header read of a stage that is inside a forward waits for the end
    of that forward (MPI passive-target RMA under MPICH: the owner must enter MPI);
  * after a step that acted the stage spends ``overhead_s`` (publish, send, the next header read:
    the loop's own cost) before its next step; a stage that waits sleeps until something it can
    see changes. Stages prefill concurrently at time 0.

The engine only decides when each stage steps; what a stage does is the loop's, so rollbacks,
discarded drafts and the lossless property (the output equals the target's own greedy output)
come out of the simulation rather than being assumed.

Batched (``SimConfig.batch_size`` B > 1): every stage runs B slots, each a sequence of its own
(its own oracle path: seed and slot) with its own window headers and links, under the rank's
``BatchedStage`` (stage/batch.py); a batched forward costs ``forward_s`` of all its slots' tokens
together, charged once to the stage's clock (the measured profiles go to 16 tokens and are
extrapolated linearly beyond: on the CPUs here a forward of 8+ rows is compute-bound). A node is
(slot, stage), numbered slot * k + stage; the stage's clock and compute are shared by its slots.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from pipespec_mpi.simulate.inputs import Acceptance, LatencyProfile, SimConfig
from pipespec_mpi.simulate.oracle import OracleLookup, OracleScorer, TokenOracle, _Compute
from pipespec_mpi.simulate.ports import SimClock, TimedReceiver, TimedSender, TimedWindow, Version
from pipespec_mpi.speculative.verifiers import Checked, Greedy
from pipespec_mpi.stage.batch import BatchedStage
from pipespec_mpi.stage.loop import Forward, StageLoop, Step
from pipespec_mpi.stage.ports import Proposal, StagePorts, StageRole
from pipespec_mpi.stage.stats import StageOutcome, StageStats

PROMPT_SEQ = 1  # the simulated prompt's sequence number
NEVER = -1  # the oracle's tokens are never EOS in timed simulations


@dataclass
class SimResult:
    method: str
    n_tokens: int
    wall_s: float
    tokens: list[int]
    reference: list[int]  # the target's own greedy output (what AR would produce)
    outcomes: list[StageOutcome]
    slots: list[SimResult] = field(default_factory=list)  # batched: one per slot (this: slot 0's)

    @property
    def tokens_per_s(self) -> float:
        """Throughput: every slot's tokens over the wall (the last slot to finish)."""
        n = sum(r.n_tokens for r in self.slots) if self.slots else self.n_tokens
        return n / self.wall_s if self.wall_s else float("nan")

    @property
    def stages(self) -> list[StageStats]:
        return [o.stats for o in self.outcomes]

    @property
    def ms_per_token(self) -> float:
        return 1000.0 * self.wall_s / self.n_tokens if self.n_tokens else float("nan")

    @property
    def lossless(self) -> bool:
        return self.tokens == self.reference[: len(self.tokens)]

    def token_balance(self, stage: int) -> int:
        """generated + adopted - discarded - final of one stage: zero when nothing is lost."""
        return self.stages[stage].token_balance(len(self.outcomes[stage].tokens))


class _Node:
    """One simulated stage (of one slot): its loop, clock, model, published headers and incoming
    proposals. The slots of a stage share its clock (``clock``) and step together."""

    def __init__(self, engine: Engine, i: int, profile: LatencyProfile, clock: SimClock) -> None:
        self.i, self.profile = i, profile
        self.k = len(engine.profiles)
        self.stage, self.slot = i % self.k, i // self.k
        self.clock = clock
        self.versions: list[Version] = []
        self.inflight: deque[tuple[float, Proposal]] = deque()
        self.model = None  # set by the engine
        self.loop: StageLoop | None = None
        self.outcome: StageOutcome | None = None

    # a slot of a BatchedStage: the loop's advance/complete, finished (done published) at DONE
    def advance(self, joining: bool = False) -> Step | Forward:
        s = self.loop.advance(joining)
        if s is Step.DONE and self.outcome is None:
            self.outcome = self.loop.finish()
        return s

    def complete(self, fwd: Forward, checked: Checked, t0: float) -> Step:
        return self.loop.complete(fwd, checked, t0)

    @property
    def waits_for_upstream(self) -> bool:
        return self.outcome is None and self.loop.waits_for_upstream

    def describe(self) -> str:
        return f"stage {self.stage} slot {self.slot}"


class Engine:
    def __init__(
        self,
        profiles: Sequence[LatencyProfile],
        acceptance: Acceptance | Sequence[Acceptance],
        cfg: SimConfig,
    ) -> None:
        k = len(profiles)
        b = cfg.batch_size
        accs = list(acceptance) if not isinstance(acceptance, Acceptance) else [acceptance]
        if not 1 <= len(accs) <= b:
            raise ValueError(f"batch_size={b}: one acceptance, or one per slot; got {len(accs)}")
        if k < 1:
            raise ValueError("need at least one stage")
        for acc in accs:
            if len(acc.rates) != k - 1:
                raise ValueError(f"{k} stages need {k - 1} acceptance rates, got {acc.rates}")
        if profiles[-1].kind == "lookup":
            raise ValueError("the last stage must be a model")
        if any(p.kind == "lookup" for p in profiles[1:]):
            raise ValueError("a lookup stage can only be stage 0")
        if cfg.method != "ar" and k < 2:
            raise ValueError(f"method={cfg.method} needs at least two stages")
        for name in ("prefill_s", "start_s"):
            v = getattr(cfg, name)
            if v is not None and len(v) != k:
                raise ValueError(f"{name}: {k} stages need {k} values, got {v}")
        self.cfg, self.profiles, self.k = cfg, list(profiles), k
        # slot s: its own path (prompt), from its acceptance (a recorded prompt's, in turn)
        self.oracles = [
            TokenOracle(accs[s % len(accs)].rates, accs[s % len(accs)].traces, seed=cfg.seed + 7919 * s)
            for s in range(b)
        ]
        self.oracle = self.oracles[0]
        self.down_lat = self._per_pair(cfg.latency_s, k)
        up = cfg.up_latency_s if cfg.up_latency_s is not None else cfg.latency_s
        self.up_lat = self._per_pair(up, k)
        self.heap: list[tuple[float, int, int]] = []
        self.seq = 0
        clocks = [SimClock(-math.inf) for _ in range(k)]
        shared = [_Compute(None, clocks[i], self._prefill_of(i)) for i in range(k)]  # batched slots'
        self.nodes = [_Node(self, n, profiles[n % k], clocks[n % k]) for n in range(b * k)]
        for n in self.nodes:
            oracle, acc = self.oracles[n.slot], accs[n.slot % len(accs)]
            i = n.stage
            if n.profile.kind == "lookup":
                n.model = OracleLookup(oracle, n.profile, acc.lookup, n.clock)
            elif b == 1:
                n.model = OracleScorer(oracle, i, n.profile.name, n.profile, n.clock, self._prefill_of(i))
            else:  # forwards charged once per batch (``_score``), prefills to the stage's clock
                n.model = OracleScorer(oracle, i, n.profile.name, clock=n.clock)
                n.model.compute = shared[i]
            free = i > 0 and profiles[i - 1].kind == "lookup"
            role = StageRole(i, k, n.i, n.i - 1 if i else None, n.i + 1 if i < k - 1 else None, free)
            ports = StagePorts(
                TimedWindow(self, n.i), n.clock,
                sender=TimedSender(self, n.i) if role.downstream is not None else None,
                receiver=TimedReceiver(self, n.i) if role.upstream is not None else None,
            )  # fmt: skip
            n.loop = StageLoop(
                role, n.model, ports, cfg.decode, NEVER,
                vocab=self.oracle.vocab, record_timeline=cfg.record_timeline,
            )  # fmt: skip

        # per stage: the slots stepped together (batched), and when the stage runs next
        self.steppers = [
            BatchedStage([self.nodes[s * k + i] for s in range(b)], clocks[i], self._scorer(i, shared[i]))
            for i in range(k)
        ]
        self.next_run = [-math.inf] * k
        self.done = [False] * k
        self.rngs = [random.Random(f"{cfg.seed}:{i}") for i in range(k)]  # draws of the loop's overhead

    def _scorer(self, i: int, compute: _Compute):
        """A batched stage's forwards: each slot's logits from its oracle, the time of one
        forward over all their tokens charged to the stage."""
        profile = self.profiles[i]

        def score(requests):
            out = [model.logits(seq, proposal) for model, seq, proposal in requests]
            n = sum(max(1, len(proposal)) for _, _, proposal in requests)
            ctx = max(len(seq) for _, seq, _ in requests)
            compute.charge(profile.forward_s(n, ctx) + profile.per_sequence_s * (len(requests) - 1))
            return out

        return score

    def _prefill_of(self, i: int) -> Callable[[int], float] | None:
        cfg = self.cfg
        if not cfg.include_prefill:
            return None
        if cfg.prefill_s is not None:
            return lambda _n_prompt: cfg.prefill_s[i]
        return self.profiles[i].prefill_s

    @staticmethod
    def _per_pair(v: float | Sequence[float], k: int) -> list[float]:
        if isinstance(v, (int, float)):
            return [float(v)] * max(k - 1, 0)
        v = [float(x) for x in v]
        if len(v) != k - 1:
            raise ValueError(f"{k} stages need {k - 1} per-pair latencies, got {v}")
        return v

    @property
    def blocking_reads(self) -> bool:
        return self.cfg.blocking_reads

    def lat(self, frm: int, to: int) -> float:
        """Delay of anything node ``frm`` publishes or sends, as seen by neighbour ``to``."""
        frm, to = frm % self.k, to % self.k
        return self.down_lat[frm] if to > frm else self.up_lat[to]

    def neighbours(self, a: int, b: int) -> bool:
        """Nodes of adjacent stages of one slot."""
        return 0 <= b < len(self.nodes) and a // self.k == b // self.k and abs(a - b) == 1

    def wake(self, node: int, t: float) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, node % self.k))

    def forward_end(self, i: int, t: float) -> float | None:
        """End of node i's stage's forward in progress at time t, if any."""
        for t0, t1 in reversed(self.nodes[i].model.compute.forwards):
            if t0 <= t < t1:
                return t1
            if t1 <= t:
                return None
        return None

    def run(self) -> SimResult:
        cfg, k, b = self.cfg, self.k, self.cfg.batch_size
        prompt = [1] * max(1, cfg.prompt_len)
        for n in self.nodes:  # the fresh headers every stage publishes before the start gate
            n.loop.reset(PROMPT_SEQ + n.slot)
        starts = cfg.start_s or (0.0,) * k
        for n in self.nodes:  # slots prefill one after another on their stage's clock
            if n.slot == 0:
                n.clock.t = starts[n.stage]
            n.loop.begin(prompt, cfg.method, Greedy())
        for i in range(k):
            self.next_run[i] = self.nodes[i].clock.now()
            self.wake(i, self.next_run[i])
        end_t = None
        events = 0
        while self.heap and end_t is None:
            t, _, i = heapq.heappop(self.heap)
            if self.done[i] or t < self.next_run[i]:
                continue  # a wake-up while computing: the stage's next step sees it anyway
            clock = self.nodes[i].clock
            clock.t = max(clock.t, t)
            step = self._step(i)
            events += 1
            if events > cfg.max_events:
                raise RuntimeError(f"simulation exceeded {cfg.max_events} events")
            if step is Step.DONE:
                self.done[i] = True
                if i == k - 1:
                    end_t = clock.now()
                continue
            self.next_run[i] = clock.now()
            if step is Step.ACTED:
                draws, rng = self.profiles[i].overhead_draws, self.rngs[i]
                self.next_run[i] += rng.choice(draws) if draws else self.profiles[i].overhead_s
            if step is not Step.WAITING:  # again at once after progress, as a rank's driver does
                self.wake(i, self.next_run[i])
            else:  # asleep until something it can see changes, or its policy wants to look again
                rechecks = [n.loop.until for n in self.nodes[i::k] if n.loop.until is not None]
                if rechecks:
                    self.wake(i, max(min(rechecks), clock.now()))
        if end_t is None:
            state = {
                n.i: (len(n.loop.p.out), len(n.loop.p.inbox.tokens), n.outcome is not None)
                for n in self.nodes
            }
            raise RuntimeError(f"simulation stalled before the last stage finished: {state}")
        wall = end_t - starts[-1]  # as the last stage measures it: from its own start
        results = []
        for s in range(b):
            nodes = self.nodes[s * k : (s + 1) * k]
            outcomes = [n.outcome or n.loop.finish() for n in nodes]
            tokens = outcomes[-1].tokens
            ref = self.oracles[s].canonical(len(tokens))
            results.append(SimResult(cfg.method, len(tokens), wall, tokens, ref, outcomes))
        if b == 1:
            return results[0]
        first = results[0]
        return replace(first, slots=results)

    def _step(self, i: int) -> Step:
        """Stage i's step: its loop's (one slot), or its slots' batched step."""
        if self.cfg.batch_size > 1:
            return self.steppers[i].step()
        n = self.nodes[i]
        s = n.advance()  # finishes the loop at DONE, as in a batch
        return n.loop.run_forward(s) if isinstance(s, Forward) else s


def simulate(
    profiles: Sequence[LatencyProfile],
    acceptance: Acceptance | Sequence[float] | Sequence[Acceptance],
    cfg: SimConfig,
) -> SimResult:
    """Simulate one prompt (``cfg.batch_size`` prompts at once, batched): ``profiles`` per stage
    (last = target), acceptance per adjacent pair (rates, an ``Acceptance``, or one ``Acceptance``
    per slot)."""
    if not isinstance(acceptance, Acceptance) and not (acceptance and isinstance(acceptance[0], Acceptance)):
        acceptance = Acceptance(tuple(float(a) for a in acceptance))
    return Engine(profiles, acceptance, cfg).run()


def mean_ms_per_token(
    profiles: Sequence[LatencyProfile],
    acceptance: Acceptance | Sequence[float],
    cfg: SimConfig,
    seeds: Sequence[int] = (0, 1, 2, 3),
) -> float:
    """Aggregate ms/token (total time over total tokens) over several seeds."""
    rs = [simulate(profiles, acceptance, replace(cfg, seed=s)) for s in seeds]
    return 1000.0 * sum(r.wall_s for r in rs) / sum(r.n_tokens for r in rs)
