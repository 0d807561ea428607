"""The timed simulator's ports: the epochs window and the proposal channels with delays.

A stage's ``TimedWindow`` publishes header versions; each neighbour sees a version from the time
it was published plus the pair's latency (versions never overtake one another), and with
``blocking_reads`` a read of a stage inside a forward first waits for that forward to end. A
``TimedSender`` delivers a proposal to the next stage's ``TimedReceiver`` after the pair's latency,
in order. The engine (engine.py) owns the per-stage state these read and write; what the ports
need of it is ``Net`` below, so this module does not import the engine. The ports' clock is
``SimClock``: a stage's simulated time, set by the engine before each step and advanced by the
stage's forwards.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Protocol

from pipespec_mpi.comm.wire import META
from pipespec_mpi.stage.ports import Header, Proposal


class SimClock:
    """A stage's simulated time: set by the engine before each step, advanced by its forwards."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class NodeState(Protocol):
    """One simulated stage's state the ports read and write."""

    clock: SimClock
    versions: list[Version]
    inflight: deque[tuple[float, Proposal]]


class Net(Protocol):
    """What the ports need of the engine: its nodes, who neighbours whom, delays, wake-ups."""

    nodes: Sequence[NodeState]

    @property
    def blocking_reads(self) -> bool: ...

    def lat(self, frm: int, to: int) -> float: ...

    def neighbours(self, a: int, b: int) -> bool: ...

    def wake(self, node: int, t: float) -> None: ...

    def forward_end(self, i: int, t: float) -> float | None: ...


class Version:
    """A published header and its tokens, and from when each neighbour sees it."""

    __slots__ = ("header", "tokens", "seen_from")

    def __init__(self, header: Header, tokens: tuple[int, ...], seen_from: dict[int, float]) -> None:
        self.header, self.tokens, self.seen_from = header, tokens, seen_from


class TimedWindow:
    """A stage's view of the epochs window: its own header versions, its neighbours' as delayed."""

    def __init__(self, engine: Net, me: int) -> None:
        self.engine, self.me = engine, me

    def publish(self, h: Header, tokens, dirty_from: int) -> None:
        eng, node = self.engine, self.engine.nodes[self.me]
        t = node.clock.now()
        seen_from = {}
        for j in (self.me - 1, self.me + 1):
            if eng.neighbours(self.me, j):
                earlier = node.versions[-1].seen_from[j] if node.versions else -math.inf
                seen_from[j] = max(earlier, t + eng.lat(self.me, j))  # no overtaking
                eng.wake(j, seen_from[j])
        node.versions.append(Version(h, tuple(tokens), seen_from))

    def _visible(self, rank: int) -> Version:
        eng, me = self.engine, self.me
        clock = eng.nodes[me].clock
        if eng.blocking_reads:
            end = eng.forward_end(rank, clock.now())
            if end is not None:
                # a read of the downstream is granted once it left its forward and published;
                # a read of the upstream (its idle flag) returns at the end of its forward
                clock.t = end + (eng.lat(rank, me) if rank > me else 0.0)
        t = clock.now()
        vs = eng.nodes[rank].versions
        for v in reversed(vs):
            if v.seen_from.get(me, -math.inf) <= t:
                return v
        return vs[0]

    def header(self, rank: int) -> Header:
        return self._visible(rank).header

    def snapshot(self, rank: int) -> tuple[Header, list[int]]:
        v = self._visible(rank)
        return v.header, list(v.tokens)

    def beat(self) -> None:
        pass


class TimedSender:
    def __init__(self, engine: Net, me: int) -> None:
        self.engine, self.me = engine, me
        self.bytes_sent = 0

    def try_send(self, prompt, epoch, start, tokens, dists=None) -> int:
        eng, down = self.engine, self.engine.nodes[self.me + 1]
        t = eng.nodes[self.me].clock.now() + eng.lat(self.me, self.me + 1)
        if down.inflight:
            t = max(t, down.inflight[-1][0])  # a channel keeps its order
        down.inflight.append((t, Proposal(prompt, epoch, start, list(tokens), dists)))
        eng.wake(self.me + 1, t)
        self.bytes_sent += 8 * (META + len(tokens))
        return len(tokens)


class TimedReceiver:
    def __init__(self, engine: Net, me: int) -> None:
        self.engine, self.me = engine, me

    def poll(self) -> list[Proposal]:
        node = self.engine.nodes[self.me]
        out = []
        while node.inflight and node.inflight[0][0] <= node.clock.now():
            out.append(node.inflight.popleft()[1])
        return out
