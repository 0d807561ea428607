"""One schedule: ``World`` runs every stage's ``StageProcess`` under the scenario's scheduler and
judges the outcome (stall, livelock, error, mismatch, counter); ``explore(family, seed)``."""

from __future__ import annotations

import random
from collections import deque

from pipespec_mpi.models.suffix import SuffixDrafter
from pipespec_mpi.simulate.explore.ports import (
    ChaosEstimates,
    ChaosRowCost,
    DriftClock,
    ExDeal,
    ExGate,
    ExHandoff,
    ExReceiver,
    ExSender,
    ExWindow,
    Link,
    TickClock,
)
from pipespec_mpi.simulate.explore.scenarios import (
    EOS,
    FAIR_ROUNDS,
    IDLE_TICKS,
    ExJob,
    Finding,
    Parts,
    Scenario,
)
from pipespec_mpi.simulate.inputs import LatencyProfile
from pipespec_mpi.simulate.oracle import OracleLookup, OracleScorer, TokenOracle
from pipespec_mpi.speculative.policy import make_policy
from pipespec_mpi.speculative.verifiers import Verifier, make_verifier, own_token
from pipespec_mpi.stage.batch import BatchedStage
from pipespec_mpi.stage.deal import JobQueue
from pipespec_mpi.stage.loop import StageLoop, Step
from pipespec_mpi.stage.ports import Header, Proposal, Proposer, Scorer, StagePorts, StageRole
from pipespec_mpi.stage.process import StageProcess
from pipespec_mpi.stage.prompt import On, Wait
from pipespec_mpi.stage.stats import StageOutcome


def autoregressive(
    model: OracleScorer, prompt: list[int], verifier: Verifier, max_new: int, eos: int
) -> list[int]:
    """The target decoding alone, token by token: what greedy and Gumbel output must equal."""
    model.prefill(prompt, room=max_new + 1)
    out: list[int] = []
    while len(out) < max_new and not (out and out[-1] == eos):
        out.append(own_token(verifier, model.logits(prompt + out, []), len(out)).token)
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
    ``BatchedStage`` over that many ``StageProcess``es, each over its own window headers, links,
    deal, gate and handoff (node s * k + i for stage i); a slot that finishes takes the next job
    from the queue the last stage's slots share."""

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
        # node n's link to n + 1 (a slot's last stage has none: its entry stays empty); one_link:
        # stage i's link to i + 1, every slot's (ports.py link_of)
        self.links = [Link() for _ in range(k - 1 if sc.one_link else b * k - 1)]
        self.inbox: dict[int, deque[Proposal]] = {}
        self.gate_arrived = [0] * (b * k)
        self.gate_complete: set[int] = set()
        self.stop_votes: set[int] = set()
        self.outcomes: dict[tuple[int, int], StageOutcome] = {}
        self.claims: dict[tuple[int, int], int] = {}  # (slot, round) -> the job index it took
        self.decoded_by: dict[tuple[int, int], int] = {}  # (job seq, stage) -> the slot that decoded it
        self.jobs = [
            ExJob(seq, ids, sc.method, sc.budgets[seq - 1] if seq - 1 < len(sc.budgets) else None)
            for seq, ids in enumerate(self.parts.prompts, 1)
        ]
        self.queue = JobQueue(len(self.jobs))
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
                # the "-adaptive" families' chaos: estimates that read as anything (ports.py)
                chaos = None
                if sc.chaos:
                    chaos = ChaosEstimates(random.Random(f"chaos:{sc.family}:{sc.seed}:{n}"))
                ports = StagePorts(
                    ExWindow(self, role), clock,
                    sender=ExSender(self, n) if i < k - 1 else None,
                    receiver=ExReceiver(self, n) if i else None,
                )  # fmt: skip
                loop = StageLoop(
                    role, self.parts.model(i), ports, sc.decode, self.eos, vocab=sc.vocab,
                    record_timeline=False, policy=make_policy(sc.decode, clock.now, chaos),
                )  # fmt: skip
                slots.append(
                    StageProcess(
                        loop,
                        ExGate(self, n),
                        ExHandoff(self, n),
                        self.jobs,
                        verifier_for=lambda job, i=i: self.verifier(job.seq, i),
                        deal=ExDeal(self, n) if b > 1 else None,
                    )  # fmt: skip
                )
            self.slot_procs += slots
            stage = slots[0] if b == 1 else BatchedStage(slots, clock, self.parts.score)
            if sc.chaos and isinstance(stage, BatchedStage):
                stage.row_cost = ChaosRowCost(random.Random(f"rows:{sc.family}:{sc.seed}:{i}"))
            self.procs.append(stage)
        self.starved: tuple[int, int] | None = None  # (stage, until tick)
        self.trace: deque[str] = deque(maxlen=60)
        # The doorbell check (host/doorbell.py): a stage whose step waited with a bell that covers
        # it (``Wait`` on a neighbour), every read fresh and no recheck due (``until`` None), sleeps until
        # something it reads changes (``stir``); a step before then must wait again, or the real
        # driver would have slept through a change (until its 10 ms limit). A wait with a recheck
        # ends by itself (the policy's own interval: its upstream's expected gap, or the end of a
        # wait for a drafter's answer), so it is not checked; nor are the chaos families, whose
        # drawn estimates change a decision with nothing changed.
        self.asleep: set[int] = set()
        self.stale_reads: set[int] = set()
        self.check_sleep = not sc.chaos

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
                    suffix.append(SuffixDrafter("suffix", max_proposal=lookup.max_proposal,
                                                min_survival=sc.drafter_survival))  # fmt: skip
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
    def stir(self, node: int) -> None:
        self.asleep.discard(node % self.sc.k)

    def _release(self, n: int, count: int) -> None:
        """Link ``n`` (node n to n + 1) lets ``count`` messages be received."""
        link = self.links[n]
        if count > link.deliverable:
            self.stir(n + 1)
        link.deliverable = count

    def _deliver(self) -> None:
        sc, rng = self.sc, self.rng
        if sc.bursts and rng.random() < 0.002:
            link = rng.choice(self.links)
            link.held_until = self.tick + rng.randint(20, 400)
        for n, link in enumerate(self.links):
            if self.tick == link.held_until:  # a held-back link delivers everything at once
                self._release(n, len(link.queue))
        if rng.random() < sc.p_deliver:
            links = enumerate(self.links)
            ready = [n for n, ln in links if ln.deliverable < len(ln.queue) and self.tick >= ln.held_until]
            if ready:
                n = rng.choice(ready)
                self._release(n, self.links[n].deliverable + 1)

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

    def _fair_rounds(self, live: list[int]) -> bool:
        """Every stage with full information: some progress within a few rounds, or a stall."""
        self.fair = True
        self.asleep.clear()  # every message delivered, every read fresh: everything is stirred
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
                asleep = i in self.asleep
                self.asleep.discard(i)
                self.stale_reads.clear()
                s = self.procs[i].step()
                self.trace.append(f"{self.tick} stage {i}: {s.name} {self.procs[i].describe()}")
                if asleep and s is not Step.WAITING:
                    return self._finding(
                        "unrung",
                        f"stage {i} moved ({s.name}) although nothing it reads changed since its step "
                        f"that waited with no recheck due: a rank would have slept through it",
                    )
                self._sleep(i, s)
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

    def _sleep(self, i: int, s: Step) -> None:
        """After stage i's step ``s``: asleep until stirred, if a rank's driver would sleep."""
        k = self.sc.k
        fresh = not any(n % k == i for n in self.stale_reads)
        stage = self.procs[i]
        if self.check_sleep and s is Step.WAITING and fresh and stage.wait() == Wait(On.NEIGHBOUR):
            self.asleep.add(i)

    def _state(self) -> str:
        parts = []
        for p in self.slot_procs:
            lp = p.loop.p
            extra = ""
            if p.phase == "decode":
                extra = (f" out={len(lp.out)} sent={lp.outbox.sent} epoch={lp.epoch}"
                         f" seen_down={lp.seen_down_epoch} pending={len(lp.inbox.tokens)}"
                         f" want={lp.want} idle={lp.idle}")  # fmt: skip
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
            if len({self.decoded_by[(job.seq, i)] for i in range(sc.k)}) > 1:
                problems.append(f"prompt {job.seq}: decoded by different slots on different stages")
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
