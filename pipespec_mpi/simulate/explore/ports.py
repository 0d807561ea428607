"""The explorer's ports and clocks: a tick clock, drifting clocks and drawn estimates for the
adaptive families, the window with stale reads, FIFO links held back and released by the
scheduler, the start gate and the handoff."""

from __future__ import annotations

import random
from collections import deque
from typing import Protocol

from pipespec_mpi.comm.wire import META
from pipespec_mpi.simulate.explore.scenarios import ExJob, Scenario
from pipespec_mpi.speculative.goodput import MAX_POSITIONS, Estimates, RowCost, RowLine
from pipespec_mpi.stage.ports import Header, Proposal, StageRole
from pipespec_mpi.stage.stats import StageOutcome


class World(Protocol):
    """The scheduler's state the ports read and write (world.py's ``World`` is one); declared here
    so that the ports do not import the scheduler."""

    sc: Scenario
    rng: random.Random
    tick: int
    fair: bool
    versions: list[list[tuple[Header, tuple[int, ...]]]]
    seen: dict[tuple[int, int], int]
    links: list[Link]
    inbox: dict[int, deque[Proposal]]  # one_link: each receiving node's messages taken off the link
    gate_arrived: list[int]
    gate_complete: set[int]
    stop_votes: set[int]
    outcomes: dict[tuple[int, int], StageOutcome]
    stale_reads: set[int]  # the nodes whose read in this step saw an older version than the newest

    def stir(self, node: int) -> None:
        """Something ``node`` reads changed (a publish or a message it can receive now): what
        rings its rank's bell (host/doorbell.py)."""


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

    def waited_an_own_step(self, now: float) -> bool:
        return self.rng.random() < 0.3

    @property
    def survival(self) -> list[float]:
        return [self.rng.random() for _ in range(MAX_POSITIONS)]

    @survival.setter
    def survival(self, value: list[float]) -> None:
        pass


class ChaosRowCost(RowCost):
    """A batched stage's row costs that read as anything at every forward (seeded): its slots'
    verifications are then cut to any length, none included, in any order."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.rng = rng

    def line(self) -> RowLine | None:
        if self.rng.random() < 0.2:
            return None
        return RowLine(
            self.rng.choice((0.0, 1e-3, 1.0)), self.rng.choice((0.0, 1e-3, 1.0)),
            self.rng.choice((0.0, 1e-3, 0.1, 1.0, 100.0)),
        )  # fmt: skip


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

    def __init__(self, world: World, role: StageRole) -> None:
        self.world, self.me = world, role.rank  # me: the node, slot * k + stage
        self.readers = [n for n in (role.upstream, role.downstream) if n is not None]

    def publish(self, h: Header, tokens, dirty_from: int) -> None:
        self.world.versions[self.me].append((h, tuple(tokens)))
        for n in self.readers:  # both neighbours of its slot read it
            self.world.stir(n)

    def _read(self, rank: int) -> tuple[Header, tuple[int, ...]]:
        w = self.world
        vs = w.versions[rank]
        lo = w.seen.get((self.me, rank), 0)
        i = len(vs) - 1 if w.fair or w.rng.random() < w.sc.p_fresh else w.rng.randint(lo, len(vs) - 1)
        w.seen[(self.me, rank)] = i
        if i < len(vs) - 1:
            w.stale_reads.add(self.me)
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


def link_of(sc: Scenario, node: int) -> int:
    """The link node ``node`` (slot * k + stage) sends on: its own to node + 1, or with
    ``one_link`` its stage's, which every slot shares (comm/mux.py)."""
    return node % sc.k if sc.one_link else node


class ExSender:
    def __init__(self, world: World, me: int) -> None:
        self.world, self.me = world, me
        self.bytes_sent = 0

    def try_send(self, prompt, epoch, start, tokens, dists=None) -> int:
        sc = self.world.sc
        link = self.world.links[link_of(sc, self.me)]
        buffers = sc.depth * sc.slots if sc.one_link else sc.depth
        posted = 0
        for off in range(0, len(tokens), sc.msg_tokens):
            if len(link.queue) >= buffers:
                break  # no free send buffer: the loop sends the rest on a later step
            chunk = list(tokens[off : off + sc.msg_tokens])
            rows = None if dists is None else dists[off : off + sc.msg_tokens]
            link.queue.append(Proposal(prompt, epoch, start + off, chunk, rows, self.me // sc.k))
            self.bytes_sent += 8 * (META + len(chunk))
            posted += len(chunk)
        return posted


class ExReceiver:
    """A slot's receiving end: what its link delivered; on a shared link, the messages for its
    slot, the others' kept in theirs (delivered in order, whichever slot polls)."""

    def __init__(self, world: World, me: int) -> None:
        self.world, self.me = world, me

    def poll(self) -> list[Proposal]:
        sc = self.world.sc
        link = self.world.links[link_of(sc, self.me - 1)]
        arrived = [link.queue.popleft() for _ in range(link.deliverable)]
        link.deliverable = 0
        if not sc.one_link:
            return arrived
        inbox = self.world.inbox
        for msg in arrived:
            inbox.setdefault(msg.slot * sc.k + self.me % sc.k, deque()).append(msg)
        mine = inbox.get(self.me, deque())
        out = list(mine)
        mine.clear()
        return out


def released(port: ExGate | ExDeal, most: int) -> bool:
    """A collective's result reaching one stage, polled after it is complete: true after 0 to
    ``most`` more polls, drawn at the first (``port.countdown`` None until then); at once in the
    fair rounds."""
    w = port.world
    if port.countdown is None:
        port.countdown = w.rng.randint(0, most)
    if w.fair or port.countdown <= 0:
        return True
    port.countdown -= 1
    return False


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
        return self.seq in w.gate_complete and released(self, w.sc.gate_delay)

    def stopped(self) -> bool:
        return self.seq in self.world.stop_votes


class ExDeal:
    """A slot's next job from the queue the slots of the last stage share (stage/deal.py): that
    stage's node claims when it opens the deal; every stage of the slot learns the claim after a
    delay of its own (the order in which stages see a vote's result is arbitrary)."""

    def __init__(self, world: World, me: int) -> None:
        self.world, self.me = world, me  # me: the node, slot * k + stage
        self.round = -1
        self.countdown: int | None = None

    def open(self) -> None:
        w = self.world
        k = w.sc.k
        self.round += 1
        self.countdown = None
        if self.me % k == k - 1:
            w.claims[(self.me // k, self.round)] = w.queue.claim()

    def dealt(self) -> int | None:
        w = self.world
        got = w.claims.get((self.me // w.sc.k, self.round))
        return got if got is not None and released(self, w.sc.gate_delay) else None


class ExHandoff:
    """Outcomes to the leader (the last stage), taken after a delay; the explorer keeps them all."""

    def __init__(self, world: World, me: int) -> None:
        self.world, self.stage = world, me % world.sc.k  # me: the node, slot * k + stage
        self.slot = me // world.sc.k
        self.seq = 0
        self.countdown = 0

    def post(self, job: ExJob, outcome: StageOutcome) -> None:
        w = self.world
        self.seq = job.seq
        w.outcomes[(job.seq, self.stage)] = outcome
        w.decoded_by[(job.seq, self.stage)] = self.slot
        self.countdown = w.rng.randint(0, w.sc.handoff_delay)

    def delivered(self) -> bool:
        w = self.world
        if self.stage == w.sc.k - 1 and any((self.seq, s) not in w.outcomes for s in range(w.sc.k)):
            return False
        if w.fair or self.countdown <= 0:
            return True
        self.countdown -= 1
        return False
