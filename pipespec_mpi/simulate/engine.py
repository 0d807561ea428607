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
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from pipespec_mpi.comm.channel import Proposal
from pipespec_mpi.simulate.inputs import Acceptance, LatencyProfile, SimConfig
from pipespec_mpi.simulate.oracle import OracleLookup, OracleScorer, SimClock, TokenOracle
from pipespec_mpi.simulate.ports import TimedReceiver, TimedSender, TimedWindow, Version
from pipespec_mpi.speculative.verifiers import Greedy
from pipespec_mpi.stage.loop import StageLoop, StageRole, Step
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
    """One simulated stage: its loop, clock, model, published headers and incoming proposals."""

    def __init__(self, engine: Engine, i: int, profile: LatencyProfile) -> None:
        self.i, self.profile = i, profile
        self.clock = SimClock(-math.inf)
        self.versions: list[Version] = []
        self.inflight: deque[tuple[float, Proposal]] = deque()
        self.next_run = -math.inf
        self.done = False
        self.rng = random.Random(f"{engine.cfg.seed}:{i}")  # draws of the loop's overhead
        self.model = None  # set by the engine
        self.loop: StageLoop | None = None
        self.outcome: StageOutcome | None = None


class Engine:
    def __init__(self, profiles: Sequence[LatencyProfile], acceptance: Acceptance, cfg: SimConfig) -> None:
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
        for name in ("prefill_s", "start_s"):
            v = getattr(cfg, name)
            if v is not None and len(v) != k:
                raise ValueError(f"{name}: {k} stages need {k} values, got {v}")
        self.cfg = cfg
        self.oracle = TokenOracle(acceptance.rates, acceptance.traces, seed=cfg.seed)
        self.down_lat = self._per_pair(cfg.latency_s, k)
        up = cfg.up_latency_s if cfg.up_latency_s is not None else cfg.latency_s
        self.up_lat = self._per_pair(up, k)
        self.heap: list[tuple[float, int, int]] = []
        self.seq = 0
        self.nodes = [_Node(self, i, p) for i, p in enumerate(profiles)]
        for n in self.nodes:
            if n.profile.kind == "lookup":
                n.model = OracleLookup(self.oracle, n.profile, acceptance.lookup, n.clock)
            else:
                n.model = OracleScorer(self.oracle, n.i, n.profile.name, n.profile, n.clock, self._prefill(n))
            role = StageRole(n.i, k, n.i, n.i - 1 if n.i else None, n.i + 1 if n.i < k - 1 else None)
            n.loop = StageLoop(
                role, n.model, TimedWindow(self, n.i),
                TimedSender(self, n.i) if role.downstream is not None else None,
                TimedReceiver(self, n.i) if role.upstream is not None else None,
                n.clock, cfg.decode, NEVER, vocab=self.oracle.vocab, record_timeline=cfg.record_timeline,
            )  # fmt: skip

    def _prefill(self, n: _Node) -> Callable[[int], float] | None:
        cfg = self.cfg
        if not cfg.include_prefill:
            return None
        if cfg.prefill_s is not None:
            return lambda _n_prompt: cfg.prefill_s[n.i]
        return n.profile.prefill_s

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

    def wake(self, stage: int, t: float) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, stage))

    def forward_end(self, i: int, t: float) -> float | None:
        """End of stage i's forward in progress at time t, if any."""
        for t0, t1 in reversed(self.nodes[i].model.compute.forwards):
            if t0 <= t < t1:
                return t1
            if t1 <= t:
                return None
        return None

    def run(self) -> SimResult:
        cfg = self.cfg
        prompt = [1] * max(1, cfg.prompt_len)
        for n in self.nodes:  # the fresh headers every stage publishes before the start gate
            n.loop.reset(PROMPT_SEQ)
        starts = cfg.start_s or (0.0,) * len(self.nodes)
        for n in self.nodes:
            n.clock.t = starts[n.i]
            n.loop.begin(prompt, cfg.method, Greedy())
            n.next_run = n.clock.now()
            self.wake(n.i, n.next_run)
        last = self.nodes[-1]
        end_t = None
        events = 0
        while self.heap and end_t is None:
            t, _, i = heapq.heappop(self.heap)
            n = self.nodes[i]
            if n.done or t < n.next_run:
                continue  # a wake-up while computing: the stage's next step sees it anyway
            n.clock.t = max(n.clock.t, t)
            step = n.loop.step()
            events += 1
            if events > cfg.max_events:
                raise RuntimeError(f"simulation exceeded {cfg.max_events} events")
            if step is Step.DONE:
                n.done = True
                n.outcome = n.loop.finish()
                if n is last:
                    end_t = n.clock.now()
                continue
            n.next_run = n.clock.now()
            if step is Step.ACTED:
                draws = n.profile.overhead_draws
                n.next_run += n.rng.choice(draws) if draws else n.profile.overhead_s
            if step is not Step.WAITING:  # again at once after progress, as a rank's driver does
                self.wake(i, n.next_run)
            # waiting: asleep until something it can see changes
        if end_t is None:
            state = {n.i: (len(n.loop.out), len(n.loop.inbox.tokens), n.done) for n in self.nodes}
            raise RuntimeError(f"simulation stalled before the last stage finished: {state}")
        outcomes = [n.outcome or n.loop.finish() for n in self.nodes]
        tokens = outcomes[-1].tokens
        wall = end_t - starts[-1]  # as the last stage measures it: from its own start
        return SimResult(cfg.method, len(tokens), wall, tokens, self.oracle.canonical(len(tokens)), outcomes)


def simulate(
    profiles: Sequence[LatencyProfile], acceptance: Acceptance | Sequence[float], cfg: SimConfig
) -> SimResult:
    """Simulate one prompt: ``profiles`` per stage (last = target), acceptance per adjacent pair."""
    if not isinstance(acceptance, Acceptance):
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
