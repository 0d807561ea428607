"""The schedule explorer: the real stage loop under seeded, adversarial schedules.

Every stage of one replica is a ``StageProcess`` (stage/process.py: reset, start gate, decode,
handoff, next prompt) over a ``StageLoop`` with an oracle model, exactly as a rank runs it; only
the ports differ. A seeded scheduler decides, tick by tick, which stage steps and when each
message becomes deliverable (FIFO per link, as MPI orders point-to-point messages), which version
of a neighbour's header a read sees (never older than what that reader saw before), when the
start gate lets each stage through and when a handoff is taken. Schedules are adversarial on
purpose: stages of very different speeds, one stage starved for long windows, a link's messages
held back and delivered in a burst, stale reads, send buffers that fill up. A quarter of the
scenarios also ask the replica to stop early (run/drain.py), its stages asking before different
jobs: the vote at the start gate must stop all of them before the same job, none started after.

A run fails when
  stall      nothing can move: every stage waits although every message was delivered, every
             read sees the newest header and every gate and handoff is released
  livelock   the schedule exceeds its tick budget
  error      an exception (a protocol invariant, a stale KV cache, a missing distribution, ...)
  mismatch   greedy or Gumbel output differs from the target decoding alone (AR), token for token
  counter    a stage's counters do not add up (tokens generated + adopted - discarded = kept, ...),
             or after a stop request a stage started a job, or the stages disagree on jobs left

A scenario (configuration plus schedule) is a pure function of its family and seed, so every
failure replays: ``python -m pipespec_mpi.simulate.explore --replay FAMILY:SEED``.

  python -m pipespec_mpi.simulate.explore --count 10000 --jobs 2      # every family
  python -m pipespec_mpi.simulate.explore --families pipespec-leviathan --count 200
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

from pipespec_mpi.comm.channel import Proposal
from pipespec_mpi.comm.window import Header
from pipespec_mpi.config import DecodeConfig, SamplingConfig, validate_decode
from pipespec_mpi.models.suffix import SuffixDrafter
from pipespec_mpi.simulate.inputs import LatencyProfile
from pipespec_mpi.simulate.oracle import OracleLookup, OracleScorer, TokenOracle
from pipespec_mpi.speculative.goodput import MAX_POSITIONS, Estimates
from pipespec_mpi.speculative.sampling import Sampler, mix
from pipespec_mpi.speculative.verifiers import Verifier, make_verifier
from pipespec_mpi.stage.batch import BatchedStage, ScoreBatch, score_alone
from pipespec_mpi.stage.loop import StageLoop, StageRole, Step
from pipespec_mpi.stage.ports import Proposer, Scorer
from pipespec_mpi.stage.process import StageProcess
from pipespec_mpi.stage.stats import StageOutcome

METHODS = ("sd", "pipespec")
RULES = ("greedy", "gumbel", "leviathan")
# "-batch": every stage decodes 2-4 sequences at once (slots, stage/batch.py), each over its own
# window, links, gate and handoff, their forwards run together
# "-suffix": stage 0 is the real suffix drafter (models/suffix.py; a batched stage's slots share its
# store) and whether its verifier waits for it (decode.wait_for_drafter) is drawn; families of
# their own, so that every seed of the older families keeps its scenario
# "-adaptive": PipeSpec under decode.policy=adaptive (speculative/goodput.py), its estimates learned
# on drifting clocks (DriftClock) or drawn anew at every decision (ChaosEstimates), so that waits,
# cut verifications and held drafters follow the seed; slots, the suffix drafter, budgets and the
# policy's own settings drawn apart
FAMILIES = tuple(f"{m}-{r}{b}" for b in ("", "-batch", "-suffix") for m in METHODS for r in RULES) + tuple(
    f"pipespec-{r}-adaptive" for r in RULES
)
EOS = 0
IDLE_TICKS = 40  # waiting steps in a row before the scheduler checks for a stall
FAIR_ROUNDS = 3  # rounds of every stage with full information that must show some progress


# ============================================================================ scenarios
@dataclass(frozen=True)
class Scenario:
    """One configuration and one schedule, drawn from (family, seed)."""

    family: str
    seed: int
    k: int
    lookup: bool  # stage 0 is a prompt lookup
    decode: DecodeConfig
    n_prompts: int
    rates: tuple[float, ...]  # agreement of stage j with stage j+1
    vocab: int
    eos_rate: float
    depth: int  # messages a link holds before its sender has to wait for a free buffer
    msg_tokens: int  # tokens per message
    speeds: tuple[float, ...]  # relative chance of each stage to be stepped
    p_deliver: float  # chance per tick that one more message becomes deliverable
    p_fresh: float  # chance that a header read sees the newest version
    starve: bool  # now and then one stage is hardly stepped for a long window
    bursts: bool  # now and then a link's messages are held back, then all delivered
    gate_delay: int  # polls after the gate opens until a stage passes it (at most)
    handoff_delay: int  # polls until a handoff is taken (at most)
    temperature: float = 1.0  # gumbel and leviathan
    top_k: int = 0
    # A stop request (run/drain.py): stage i asks to stop before job stop_before + stop_lag[i];
    # the replica's vote at the gate stops every stage before the first job any of them asks to.
    stop_before: int | None = None
    stop_lag: tuple[int, ...] = ()
    slots: int = 1  # sequences in flight per stage (the "-batch" families: 2-4)
    suffix: bool = False  # stage 0 is the real suffix drafter (the "-suffix" families)
    # per prompt: its own token budget (a row's max_tokens), None for decode.max_new_tokens
    # (drawn in the "-batch" and "-suffix" families only, apart from every other field)
    budgets: tuple[int | None, ...] = ()
    # "-adaptive" families: the adaptive policy reads estimates that are anything at every decision
    # (ChaosEstimates), so that every order of the decisions it can take is explored
    chaos: bool = False

    def budget(self, seq: int) -> int:
        """Prompt ``seq``'s token budget (1-based, as the jobs are numbered)."""
        own = self.budgets[seq - 1] if seq - 1 < len(self.budgets) else None
        return own or self.decode.max_new_tokens

    @property
    def method(self) -> str:
        return self.family.split("-")[0]

    @property
    def rule(self) -> str:
        return self.family.split("-")[1]

    @classmethod
    def draw(cls, family: str, seed: int, preset: str | None = None, **fixed) -> Scenario:
        """The scenario of (family, seed); a ``preset`` (PRESETS) or ``fixed`` fields set part of
        the configuration and leave the rest, and the schedule, to the seed."""
        if family not in FAMILIES:
            raise ValueError(f"family {family!r}: one of {', '.join(FAMILIES)}")
        rng = random.Random(f"scenario:{family}:{seed}")
        method = family.split("-")[0]
        k = rng.choice((2, 3, 3, 4))
        lookahead = rng.randint(0, 4)
        sd_window = None
        if method == "sd":
            sd_window = rng.choice((None, 1, 2, 3, 4))
            if sd_window is None:
                lookahead = max(1, lookahead)
        w = max(1, lookahead, sd_window or 0)
        decode = DecodeConfig(
            lookahead=lookahead,
            sd_window=sd_window,
            max_new_tokens=rng.randint(3, 24),
            max_run_ahead=rng.choice([x for x in (1, 2, 3, 4, 6, 8, 16) if x >= w]),
            max_verify=rng.choice((w, w + 1, max(w, 4), 16)),
            policy="static",  # the "-adaptive" families set their own, below
        )
        fixed = {**(PRESETS[preset] if preset else {}), **fixed}
        k = fixed.get("k", k)
        decode = fixed.get("decode", decode)
        problems = validate_decode(decode, sd_needed=method == "sd")
        if problems:
            raise AssertionError(f"{family}:{seed} drew an invalid configuration: {problems}")
        sc = cls(
            family=family,
            seed=seed,
            k=k,
            lookup=rng.random() < 0.3,
            decode=decode,
            n_prompts=rng.randint(1, 3),
            rates=tuple(rng.choice((0.0, 1.0, rng.random(), rng.random())) for _ in range(k - 1)),
            vocab=rng.choice((5, 8, 16, 64)),
            eos_rate=rng.choice((0.0, 0.0, 0.03, 0.1)),
            depth=rng.choice((1, 2, 8)),
            msg_tokens=rng.choice((1, 2, 4, 32)),
            speeds=tuple(rng.choice((0.05, 0.3, 1.0, 1.0, 3.0)) for _ in range(k)),
            p_deliver=rng.choice((0.05, 0.3, 1.0)),
            p_fresh=rng.choice((0.1, 0.5, 0.9, 1.0)),
            starve=rng.random() < 0.3,
            bursts=rng.random() < 0.3,
            gate_delay=rng.choice((0, 3, 30)),
            handoff_delay=rng.choice((0, 3, 30)),
        )
        if family.endswith("-batch"):
            b = random.Random(f"slots:{family}:{seed}")
            slots = b.randint(2, 4)
            sc = replace(sc, slots=slots, n_prompts=b.randint(slots, 2 * slots + 1))
        # drawn apart from the rest, so that every other field of a seed is what it was before
        stop = random.Random(f"stop:{family}:{seed}")
        if stop.random() < 0.25:
            sc = replace(sc, stop_before=stop.randint(1, sc.n_prompts),
                         stop_lag=tuple(stop.choice((0, 0, 1)) for _ in range(sc.k)))  # fmt: skip
        if family.endswith("-suffix"):  # the suffix drafter, and whether its verifier waits for it
            dr = random.Random(f"drafter:{family}:{seed}")
            sc = replace(sc, lookup=True, suffix=True)
            if "decode" not in fixed:
                sc = replace(sc, decode=replace(sc.decode, wait_for_drafter=dr.random() < 0.7))
        if family.endswith("-adaptive"):
            ad = random.Random(f"adaptive:{family}:{seed}")
            if ad.random() < 0.4:
                slots = ad.randint(2, 4)
                sc = replace(sc, slots=slots, n_prompts=ad.randint(slots, 2 * slots + 1))
            if ad.random() < 0.3:
                sc = replace(sc, lookup=True, suffix=True)
            if "decode" not in fixed:
                policy = dict(policy="adaptive", draft_survival=ad.choice((0.0, 0.3, 0.5, 0.9)),
                              accept_prior=ad.choice((0.0, 0.5, 1.0, ad.random())),
                              estimate_rate=ad.choice((0.05, 0.3, 1.0)))  # fmt: skip
                sc = replace(sc, decode=replace(sc.decode, **policy))
            sc = replace(sc, chaos=ad.random() < 0.5)
        if family.endswith(("-batch", "-suffix", "-adaptive")):
            bu = random.Random(f"budgets:{family}:{seed}")
            if bu.random() < 0.5:
                top = sc.decode.max_new_tokens
                sc = replace(
                    sc, budgets=tuple(bu.choice((None, 1, bu.randint(1, top))) for _ in range(sc.n_prompts))
                )
        return replace(sc, **{k: v for k, v in fixed.items() if k not in ("k", "decode")})

    def stop_requested(self, stage: int, seq: int) -> bool:
        return self.stop_before is not None and seq >= self.stop_before + self.stop_lag[stage]

    def sampler(self, seq: int) -> Sampler:
        if self.rule == "greedy":
            return Sampler()
        key = mix(self.seed, seq)
        return Sampler(
            SamplingConfig(temperature=self.temperature, top_k=self.top_k, coupling=self.rule), key
        )


# Fixed configurations, explored under every schedule the seeds draw. "slurm-sweep" is the job of
# the Slurm sweep test that once stalled (tiny hierarchy, lookahead 2, max_run_ahead 8, 16 tokens).
PRESETS: dict[str, dict] = {
    "slurm-sweep": dict(
        k=3,
        lookup=False,
        n_prompts=2,
        decode=DecodeConfig(lookahead=2, max_run_ahead=8, max_new_tokens=16, policy="static"),
    ),
}


@dataclass(frozen=True)
class Finding:
    family: str
    seed: int
    verdict: str  # ok | stall | livelock | error | mismatch | counter
    detail: str = ""
    ticks: int = 0

    @property
    def ok(self) -> bool:
        return self.verdict == "ok"


@dataclass(frozen=True)
class ExJob:
    seq: int
    prompt_ids: list[int]
    method: str
    max_new_tokens: int | None = None


@dataclass(frozen=True)
class Parts:
    """What the stages compute with, when not the scenario's oracle: a model per stage (a fresh
    one per call), the prompts (one job each) and EOS; ``wrap`` replaces every stage's verifier
    and ``score`` runs a batched stage's forwards (broken ones, for the tests that must catch
    them; real models batched: tests/unit/test_batch.py)."""

    model: Callable[[int], Scorer | Proposer]
    prompts: list[list[int]]
    eos: int
    wrap: Callable[[Verifier], Verifier] | None = None
    score: ScoreBatch = score_alone  # a batched stage's forwards (the "-batch" families)


# ============================================================================ the explorer's ports
class TickClock:
    def __init__(self, world: World) -> None:
        self.world = world

    def now(self) -> float:
        return float(self.world.tick)


class ChaosEstimates(Estimates):
    """Estimates that read as anything, drawn anew at every decision (seeded): the adaptive policy
    then takes any of its decisions (wait, verify a cut or the whole pending run, step on its own,
    hold a drafter) in any order; each must keep the protocol lossless and live."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__(accept_prior=0.5, rate=0.1)
        self.rng = rng

    def acceptance(self) -> list[float]:
        return [self.rng.choice((0.0, 1.0, self.rng.random())) for _ in range(MAX_POSITIONS)]

    def costs(self, limit: int) -> list[float]:
        c0, slope = self.rng.choice((1e-3, 1.0, 100.0)), self.rng.choice((0.0, 0.05, 1.0))
        return [c0 * (1 + slope * k) for k in range(limit + 1)]

    def gap(self) -> float | None:
        return self.rng.choice((None, 0.0, 1e-3, 1.0, 100.0))

    def wait_gap(self, now: float) -> float | None:
        return self.rng.choice((None, 0.0, 1e-3, 1.0, 100.0))

    @property
    def survival(self) -> list[float]:
        return [self.rng.random() for _ in range(MAX_POSITIONS)]

    @survival.setter
    def survival(self, value: list[float]) -> None:
        pass


class DriftClock:
    """A stage's clock in the "-adaptive" families: the world's tick plus a drawn amount on every
    reading, so that forwards take time (they are bracketed by readings), waiting takes time, and
    each stage's costs and its upstream's delivery gaps differ and drift: what the adaptive policy
    estimates, and so where it waits, cuts a verification or holds a drafter, follows the seed."""

    def __init__(self, world: World, stage: int) -> None:
        self.world = world
        self.rng = random.Random(f"clock:{world.sc.family}:{world.sc.seed}:{stage}")
        self.steps = tuple(self.rng.choice((0.0, 0.1, 1.0, 5.0, 40.0)) for _ in range(3))
        self.drift = 0.0

    def now(self) -> float:
        self.drift += self.rng.choice(self.steps)
        return float(self.world.tick) + self.drift


class ExWindow:
    """A stage's view of the epochs window: any version of a neighbour's header that is not older
    than the one this stage saw last (memory is coherent, but a read may come early)."""

    def __init__(self, world: World, me: int) -> None:
        self.world, self.me = world, me

    def publish(self, *, prompt, epoch, tokens, dirty_from, done=False, want=0, idle=False) -> None:
        h = Header(prompt, epoch, len(tokens), bool(done), want, bool(idle))
        self.world.versions[self.me].append((h, tuple(tokens)))

    def _read(self, rank: int) -> tuple[Header, tuple[int, ...]]:
        w = self.world
        vs = w.versions[rank]
        lo = w.seen.get((self.me, rank), 0)
        i = len(vs) - 1 if w.fair or w.rng.random() < w.sc.p_fresh else w.rng.randint(lo, len(vs) - 1)
        w.seen[(self.me, rank)] = i
        return vs[i]

    def header(self, rank: int) -> Header:
        return self._read(rank)[0]

    def snapshot(self, rank: int) -> tuple[Header, list[int]]:
        h, toks = self._read(rank)
        return h, list(toks)

    def beat(self) -> None:
        pass


class Link:
    """Messages from stage i to i+1 in sending order; the first ``deliverable`` may be received."""

    def __init__(self) -> None:
        self.queue: deque[Proposal] = deque()
        self.deliverable = 0
        self.held_until = 0  # bursts: nothing becomes deliverable before this tick


class ExSender:
    def __init__(self, world: World, me: int) -> None:
        self.world, self.me = world, me
        self.bytes_sent = 0

    def try_send(self, prompt, epoch, start, tokens, dists=None) -> int:
        link, sc = self.world.links[self.me], self.world.sc
        posted = 0
        for off in range(0, len(tokens), sc.msg_tokens):
            if len(link.queue) >= sc.depth:
                break  # no free send buffer: the loop sends the rest on a later step
            chunk = list(tokens[off : off + sc.msg_tokens])
            rows = None if dists is None else dists[off : off + sc.msg_tokens]
            link.queue.append(Proposal(prompt, epoch, start + off, chunk, rows))
            self.bytes_sent += 8 * (4 + len(chunk))
            posted += len(chunk)
        return posted


class ExReceiver:
    def __init__(self, world: World, me: int) -> None:
        self.world, self.me = world, me

    def poll(self) -> list[Proposal]:
        link = self.world.links[self.me - 1]
        out = [link.queue.popleft() for _ in range(link.deliverable)]
        link.deliverable = 0
        return out


class ExGate:
    """The start gate of one slot: passes once every stage opened it for this prompt, after a
    delay per stage (the order in which stages leave a barrier is arbitrary); the vote to stop
    early is the OR of the stages' requests when they opened it."""

    def __init__(self, world: World, me: int) -> None:
        self.world, self.me = world, me  # me: the node, slot * k + stage
        self.seq = 0
        self.countdown: int | None = None

    def open(self, seq: int) -> None:
        w = self.world
        k = w.sc.k
        self.seq, self.countdown = seq, None
        w.gate_arrived[self.me] = seq
        if w.sc.stop_requested(self.me % k, seq):
            w.stop_votes.add(seq)
        first = self.me - self.me % k
        if all(s == seq for s in w.gate_arrived[first : first + k]):
            w.gate_complete.add(seq)

    def passed(self) -> bool:
        w = self.world
        if self.seq not in w.gate_complete:
            return False
        if self.countdown is None:
            self.countdown = w.rng.randint(0, w.sc.gate_delay)
        if w.fair or self.countdown <= 0:
            return True
        self.countdown -= 1
        return False

    def stopped(self) -> bool:
        return self.seq in self.world.stop_votes


class ExHandoff:
    """Outcomes to the leader (the last stage), taken after a delay; the explorer keeps them all."""

    def __init__(self, world: World, me: int) -> None:
        self.world, self.stage = world, me % world.sc.k  # me: the node, slot * k + stage
        self.seq = 0
        self.countdown = 0

    def post(self, job: ExJob, outcome: StageOutcome) -> None:
        w = self.world
        self.seq = job.seq
        w.outcomes[(job.seq, self.stage)] = outcome
        self.countdown = w.rng.randint(0, w.sc.handoff_delay)

    def delivered(self) -> bool:
        w = self.world
        if self.stage == w.sc.k - 1 and any((self.seq, s) not in w.outcomes for s in range(w.sc.k)):
            return False
        if w.fair or self.countdown <= 0:
            return True
        self.countdown -= 1
        return False


# ============================================================================ one schedule
def autoregressive(
    model: OracleScorer, prompt: list[int], verifier: Verifier, max_new: int, eos: int
) -> list[int]:
    """The target decoding alone, token by token: what greedy and Gumbel output must equal."""
    model.prefill(prompt, room=max_new + 1)
    out: list[int] = []
    while len(out) < max_new and not (out and out[-1] == eos):
        out.append(verifier.draw(model.logits(prompt + out, []), len(out)).token)
        model.truncate(len(prompt) + len(out) - 1)
    return out


def stage_counter_problems(outcome: StageOutcome, stage: int, k: int, lookup: bool) -> list[str]:
    """What does not add up in one stage's stats of one prompt."""
    st, n = outcome.stats, len(outcome.tokens)
    p = []
    if st.token_balance(n):
        p.append(f"generated {st.tokens_generated} + adopted {st.tokens_adopted} - discarded "
                 f"{st.tokens_discarded} != kept {n}")  # fmt: skip
    if len(st.verify_trace) != st.verifications:
        p.append(f"{len(st.verify_trace)} verify_trace entries for {st.verifications} verifications")
    if sum(v for v, _ in st.verify_trace) != st.tokens_verified:
        p.append("verify_trace does not sum to tokens_verified")
    if sum(a for _, a in st.verify_trace) != st.tokens_accepted:
        p.append("verify_trace does not sum to tokens_accepted")
    if any(not 0 <= a <= v for v, a in st.verify_trace):
        p.append("a verification accepted more than it verified")
    scorer_calls = 0 if lookup and stage == 0 else st.draft_steps + st.own_steps + st.verifications
    if st.forward_calls != scorer_calls:
        p.append(f"{st.forward_calls} forwards for {st.draft_steps} drafts, {st.own_steps} own steps, "
                 f"{st.verifications} verifications")  # fmt: skip
    if stage == k - 1 and (st.tokens_adopted or st.tokens_discarded or st.tokens_generated != n):
        p.append("the last stage adopted or discarded tokens")
    return [f"stage {stage}: {x}" for x in p]


class World:
    """One replica of k stages under one scenario's schedule. With ``slots`` > 1 each stage is a
    ``BatchedStage`` over that many ``StageProcess``es; slot s decodes every slots-th job, over
    its own window headers, links, gate and handoff (node s * k + i for stage i)."""

    def __init__(self, sc: Scenario, parts: Parts | None = None, max_ticks: int | None = None) -> None:
        self.sc = sc
        self.rng = random.Random(f"schedule:{sc.family}:{sc.seed}")
        self.tick = 0
        self.fair = False
        self.parts = parts or self._oracle_parts()
        self.eos = self.parts.eos
        k, b = sc.k, sc.slots
        self.versions: list[list[tuple[Header, tuple[int, ...]]]] = [
            [(Header(-1, 0, 0, False, 0, False), ())] for _ in range(b * k)
        ]
        self.seen: dict[tuple[int, int], int] = {}
        # node n's link to n + 1 (a slot's last stage has none: its entry stays empty)
        self.links = [Link() for _ in range(b * k - 1)]
        self.gate_arrived = [0] * (b * k)
        self.gate_complete: set[int] = set()
        self.stop_votes: set[int] = set()
        self.outcomes: dict[tuple[int, int], StageOutcome] = {}
        self.jobs = [
            ExJob(seq, ids, sc.method, sc.budgets[seq - 1] if seq - 1 < len(sc.budgets) else None)
            for seq, ids in enumerate(self.parts.prompts, 1)
        ]
        n_tokens = len(self.jobs) * sc.decode.max_new_tokens
        self.max_ticks = max_ticks or 20_000 + 2_000 * k * n_tokens
        adaptive = sc.family.endswith("-adaptive")
        self.procs: list[StageProcess | BatchedStage] = []
        self.slot_procs: list[StageProcess] = []  # every slot of every stage
        for i in range(k):
            clock = DriftClock(self, i) if adaptive else TickClock(self)
            slots = []
            for s in range(b):
                n = s * k + i
                free = i == 1 and sc.lookup
                role = StageRole(i, k, n, n - 1 if i else None, n + 1 if i < k - 1 else None, free)
                loop = StageLoop(
                    role, self.parts.model(i), ExWindow(self, n), ExSender(self, n) if i < k - 1 else None,
                    ExReceiver(self, n) if i else None, clock, sc.decode, self.eos, vocab=sc.vocab,
                    record_timeline=False,
                )  # fmt: skip
                slots.append(
                    StageProcess(
                        loop,
                        ExGate(self, n),
                        ExHandoff(self, n),
                        self.jobs[s::b],
                        verifier_for=lambda job, i=i: self.verifier(job.seq, i),
                    )  # fmt: skip
                )
            self.slot_procs += slots
            if sc.chaos:
                for p in slots:
                    p.loop.est = ChaosEstimates(
                        random.Random(f"chaos:{sc.family}:{sc.seed}:{p.loop.role.rank}")
                    )
            self.procs.append(slots[0] if b == 1 else BatchedStage(slots, clock, self.parts.score))
        self.starved: tuple[int, int] | None = None  # (stage, until tick)
        self.trace: deque[str] = deque(maxlen=60)

    def _oracle_parts(self) -> Parts:
        sc, rng = self.sc, self.rng
        self.oracle = TokenOracle(sc.rates, seed=sc.seed, vocab=sc.vocab, eos=EOS, eos_rate=sc.eos_rate,
                                  per_prompt=True)  # fmt: skip
        lookup = LatencyProfile("lookup", kind="lookup", max_proposal=rng.choice((1, 3, 8)),
                                lookup_hit_rate=rng.choice((0.3, 0.8)))  # fmt: skip

        suffix: list[SuffixDrafter] = []  # one drafter; the slots of a batched stage 0 share it

        def model(i: int) -> Scorer | Proposer:
            if i == 0 and sc.lookup and sc.suffix:
                if not suffix:
                    suffix.append(SuffixDrafter("suffix", max_proposal=lookup.max_proposal, min_survival=0.0))
                    return suffix[0]
                return suffix[0].for_slot()
            if i == 0 and sc.lookup:
                return OracleLookup(self.oracle, lookup)
            return OracleScorer(self.oracle, i)

        prompts = [
            [rng.randrange(1, sc.vocab) for _ in range(rng.randint(1, 6))] for _ in range(sc.n_prompts)
        ]
        return Parts(model, prompts, EOS)

    def verifier(self, seq: int, stage: int) -> Verifier:
        v = make_verifier(self.sc.sampler(seq), stage)
        return self.parts.wrap(v) if self.parts.wrap else v

    def outputs(self) -> list[list[int]]:
        """The last stage's output for each job that ran, in order (after ``run``)."""
        k = self.sc.k
        return [
            self.outcomes[(job.seq, k - 1)].tokens for job in self.jobs if (job.seq, k - 1) in self.outcomes
        ]

    # ---------------------------------------------------------------- the scheduler
    def _deliver(self) -> None:
        sc, rng = self.sc, self.rng
        if sc.bursts and rng.random() < 0.002:
            link = rng.choice(self.links)
            link.held_until = self.tick + rng.randint(20, 400)
        for link in self.links:
            if self.tick == link.held_until:  # a held-back link delivers everything at once
                link.deliverable = len(link.queue)
        if rng.random() < sc.p_deliver:
            ready = [ln for ln in self.links if ln.deliverable < len(ln.queue) and self.tick >= ln.held_until]
            if ready:
                rng.choice(ready).deliverable += 1

    def _pick(self, live: list[int]) -> int:
        sc, rng = self.sc, self.rng
        if sc.starve and (self.starved is None or self.tick >= self.starved[1]) and rng.random() < 0.003:
            self.starved = (rng.randrange(sc.k), self.tick + rng.randint(50, 600))
        weights = []
        for i in live:
            w = sc.speeds[i]
            if self.starved is not None and self.starved[0] == i and self.tick < self.starved[1]:
                w *= 0.01
            weights.append(w)
        return rng.choices(live, weights)[0]

    def _fingerprint(self) -> tuple:
        return tuple((p.phase, p.index) for p in self.slot_procs)

    def _fair_rounds(self, live: list[int]) -> bool:
        """Every stage with full information: some progress within a few rounds, or a stall."""
        self.fair = True
        try:
            for _ in range(FAIR_ROUNDS):
                for link in self.links:
                    link.deliverable, link.held_until = len(link.queue), 0
                for i in list(live):
                    self.tick += 1
                    s = self.procs[i].step()
                    self.trace.append(f"{self.tick} fair stage {i}: {s.name}")
                    if s is Step.DONE:
                        live.remove(i)
                    if s is not Step.WAITING:
                        return True
            return not live
        finally:
            self.fair = False

    def run(self) -> Finding:
        sc = self.sc
        live = list(range(sc.k))
        idle = 0
        try:
            while live:
                self.tick += 1
                if self.tick > self.max_ticks:
                    return self._finding("livelock", f"{self.max_ticks} ticks without finishing")
                self._deliver()
                i = self._pick(live)
                s = self.procs[i].step()
                self.trace.append(f"{self.tick} stage {i}: {s.name} {self.procs[i].describe()}")
                if s is Step.DONE:
                    live.remove(i)
                idle = idle + 1 if s is Step.WAITING else 0
                if idle > IDLE_TICKS:
                    idle = 0
                    if not self._fair_rounds(live):
                        return self._finding("stall", self._state())
        except Exception as err:  # noqa: BLE001 - any exception is a finding, reported with its seed
            return self._finding("error", f"{type(err).__name__}: {err}")
        return self._check()

    def _state(self) -> str:
        parts = []
        for p in self.slot_procs:
            lp = p.loop
            extra = ""
            if p.phase == "decode":
                extra = (f" out={len(lp.out)} sent={lp.sent} epoch={lp.epoch} seen_down={lp.seen_down_epoch}"
                         f" pending={len(lp.inbox.tokens)} want={lp.want} idle={lp.idle}")  # fmt: skip
            parts.append(f"[{p.describe()}{extra}]")
        links = [f"{len(ln.queue)} queued" for ln in self.links]
        return " ".join(parts) + f" links: {links}"

    def _finding(self, verdict: str, detail: str) -> Finding:
        return Finding(self.sc.family, self.sc.seed, verdict, detail, self.tick)

    # ---------------------------------------------------------------- checks
    def _check(self) -> Finding:
        sc = self.sc
        problems: list[str] = []
        stop_at = min(self.stop_votes, default=len(self.jobs) + 1)
        left = {p.jobs_left for p in self.procs}  # a batched stage: the sum over its slots
        if left != {len(self.jobs) + 1 - stop_at}:
            problems.append(f"jobs left {sorted(left)} after a stop before job {stop_at}")
        for job in self.jobs:
            if job.seq >= stop_at:
                started = [i for i in range(sc.k) if (job.seq, i) in self.outcomes]
                if started:
                    problems.append(f"prompt {job.seq}: stages {started} ran it after the stop")
                continue
            outs = [self.outcomes[(job.seq, i)] for i in range(sc.k)]
            last = outs[-1].tokens
            for i, o in enumerate(outs):
                problems += [f"prompt {job.seq}: {x}" for x in stage_counter_problems(o, i, sc.k, sc.lookup)]
            if sc.rule != "leviathan":
                target = self.parts.model(sc.k - 1)
                verifier = self.verifier(job.seq, sc.k - 1)
                ref = autoregressive(target, job.prompt_ids, verifier, sc.budget(job.seq), self.eos)
                if last != ref:
                    return self._finding("mismatch", f"prompt {job.seq}: {last} != AR {ref}")
            elif len(last) > sc.budget(job.seq) or (self.eos in last[:-1]):
                problems.append(f"prompt {job.seq}: {len(last)} tokens, EOS inside")
        if problems:
            return self._finding("counter", "; ".join(problems[:5]))
        return self._finding("ok", "")


def explore(family: str, seed: int, preset: str | None = None) -> Finding:
    """Run one scenario; the finding says whether it finished and was right."""
    return World(Scenario.draw(family, seed, preset)).run()


# ============================================================================ many schedules
@dataclass
class Tally:
    family: str
    schedules: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    failures: list[dict] = field(default_factory=list)  # the first few, with seeds

    def add(self, f: Finding) -> None:
        self.schedules += 1
        self.counts[f.verdict] = self.counts.get(f.verdict, 0) + 1
        if not f.ok and len(self.failures) < 10:
            self.failures.append(asdict(f))


def _run_chunk(args: tuple[str, int, int, str | None]) -> list[Finding]:
    family, start, count, preset = args
    return [explore(family, s, preset) for s in range(start, start + count)]


def sweep(
    families: Sequence[str], count: int, start: int = 0, jobs: int = 1, preset: str | None = None
) -> list[Tally]:
    tallies = {f: Tally(f) for f in families}
    chunks = [
        (f, s, min(200, start + count - s), preset)
        for f in families
        for s in range(start, start + count, 200)
    ]
    if jobs > 1:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(jobs) as pool:
            results = pool.imap_unordered(_run_chunk, chunks)
            for found in results:
                for f in found:
                    tallies[f.family].add(f)
    else:
        for ch in chunks:
            for f in _run_chunk(ch):
                tallies[f.family].add(f)
    return list(tallies.values())


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m pipespec_mpi.simulate.explore", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--families", default="all", help=f"comma-separated, or all: {', '.join(FAMILIES)}")
    ap.add_argument("--count", type=int, default=200, help="schedules per family")
    ap.add_argument("--start", type=int, default=0, help="first seed")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes")
    ap.add_argument("--preset", choices=sorted(PRESETS), help="a fixed configuration under every schedule")
    ap.add_argument(
        "--replay", metavar="FAMILY:SEED", help="run one schedule and print its scenario and trace"
    )
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.replay:
        family, _, seed = a.replay.partition(":")
        world = World(Scenario.draw(family, int(seed), a.preset))
        found = world.run()
        print(world.sc)
        print("\n".join(world.trace))
        print(found)
        return 0 if found.ok else 1
    families = FAMILIES if a.families == "all" else tuple(a.families.split(","))
    t0 = time.perf_counter()
    tallies = sweep(families, a.count, a.start, a.jobs, a.preset)
    dt = time.perf_counter() - t0
    if a.json:
        print(json.dumps({"seconds": dt, "families": [asdict(t) for t in tallies]}, indent=2))
    else:
        for t in tallies:
            bad = {k: v for k, v in t.counts.items() if k != "ok"}
            print(f"{t.family:<20} {t.schedules:>7} schedules  failures: {bad or 'none'}")
            for f in t.failures:
                print(f"    {f['family']}:{f['seed']} {f['verdict']}: {f['detail'][:300]}")
        preset = f", preset {a.preset}" if a.preset else ""
        print(f"seeds {a.start}..{a.start + a.count - 1}{preset}, {dt:.0f} s")
    return 0 if all(t.counts.get("ok", 0) == t.schedules for t in tallies) else 1


if __name__ == "__main__":
    sys.exit(main())
