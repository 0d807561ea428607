"""Doorbells: a waiting rank sleeps until a neighbour on its node publishes or sends.

A stage with nothing to do used to poll: its whole iteration (window headers, channels, the
policy, a drafter's lookup) at 20 us doubling to 1 ms after every change. In a batched phase
that is every slot's iteration, and the polling took far more of a core than the drafter's own
work, from a target computing on all of them (docs/notebook.md, "Measurements behind the code's
choices").

Every rank binds a datagram socket in Linux's abstract namespace (no file; gone with the
process), named by a token rank 0 draws for the job and the rank. A stage's publish (what both
neighbours read) and its posted proposals (what the downstream reads) ring the neighbours: one
non-blocking one-byte ``sendto``, dropped when the bell's queue is full (it rings anyway). A
waiting driver (run/drive.py ``drive``) sleeps in ``select`` on its bell, drains it and
steps: a ring that comes during the step wakes the next wait at once, so none is lost.

A bell *covers* a rank (``bell_covers``) when every neighbour reached it at setup (a hello
through the bells, run/setup.py ``open_doorbell``: they share the node and its network
namespace) and a ring means the change is already visible (the shared-memory window, MPI
proposals without distributions); where it does not, the driver polls as before, waking early
when rung.

The collectives that begin and end a job (the deal, the start gate, the handoff: MPI
non-blocking votes and sends, which ring nobody) complete only as their members poll them; a
stage that joins one rings the replica's other stages (``RingingGate``, ``RingingDeal``,
``RingingHandoff``), so that a rank waiting there may sleep longer between polls and poll again
soon after a ring (``drive``'s waits on a collective, where ``Doorbell.collectives``).
"""

from __future__ import annotations

import os
import select
import socket
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING

import numpy as np

from pipespec_mpi.stage.ports import Header, Sender, Window

if TYPE_CHECKING:
    from pipespec_mpi.stage.deal import Deal
    from pipespec_mpi.stage.process import Gate, Handoff, Job
    from pipespec_mpi.stage.stats import StageOutcome

_PREFIX = b"\0pipespec-bell-"


def bell_address(token: str, rank: int) -> bytes:
    """The abstract socket name of ``rank``'s bell in the job ``token``."""
    return _PREFIX + f"{token}-{rank}".encode()


class Doorbell:
    """This rank's bell; ``ring(rank)`` rings a neighbour's. ``None`` from ``open`` where the OS
    has no abstract sockets (then every driver polls)."""

    def __init__(self, sock: socket.socket, token: str, rank: int) -> None:
        self.sock, self.token, self.rank = sock, token, rank
        # every change the rank's stage waits for rings this bell by the time it is visible (set
        # by run/setup.py open_doorbell); False: its driver polls, woken early by a ring
        self.covers = False
        # every other stage of the replica rings it as it joins a collective (the deal, the start
        # gate, the handoff): its driver may sleep between polls there (set by open_doorbell)
        self.collectives = False
        self._holding = 0  # nested ``held`` blocks open
        self._owed: set[int] = set()  # the ranks rung inside them

    @contextmanager
    def held(self) -> Iterator[None]:
        """Rings inside the block reach each rank once, as it ends. A batched stage's slots
        publish one after another, each ringing its neighbours: a waiting neighbour woke for each
        and stepped all of its slots again, taking CPU from the target's forwards (docs/notebook.md,
        "Measurements behind the code's choices"). The block is a loop over the slots' bookkeeping
        (a millisecond or two), never a forward: a ring comes at most that late, and never after
        the stage's driver sleeps."""
        self._holding += 1
        try:
            yield
        finally:
            self._holding -= 1
            if not self._holding:
                owed, self._owed = sorted(self._owed), set()
                for r in owed:
                    self._send(r)

    def ring(self, rank: int) -> None:
        """Wake ``rank`` if it waits (never blocks; a bell it cannot reach is not rung); inside
        ``held``, once the block ends."""
        if self._holding:
            self._owed.add(rank)
        else:
            self._send(rank)

    def _send(self, rank: int) -> None:
        with suppress(OSError):  # full (it will wake anyway), gone, or on another node
            self.sock.sendto(b"\1", bell_address(self.token, rank))

    @classmethod
    def open(cls, token: str, rank: int) -> Doorbell | None:
        if not hasattr(socket, "AF_UNIX") or os.uname().sysname != "Linux":
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind(bell_address(token, rank))
        except OSError:
            sock.close()
            return None
        sock.setblocking(False)
        return cls(sock, token, rank)

    def wait(self, timeout_s: float) -> bool:
        """Sleep until rung or ``timeout_s`` passed, then take every ring that came; whether one did."""
        if timeout_s > 0:
            select.select([self.sock], [], [], timeout_s)
        return bool(self.drain())

    def drain(self) -> list[int]:
        """Take the rings that came; the ranks they came from (as far as they are bells of this job)."""
        senders = []
        while True:
            try:
                _, addr = self.sock.recvfrom(16)
            except (BlockingIOError, InterruptedError):
                return senders
            senders.append(_rank_of(addr, self.token))

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def bell_covers(window: str, transport: str, leviathan: bool, neighbours: set[int], heard: set[int]) -> bool:
    """Whether a rank's bell covers what its stage waits for: every neighbour's hello came
    (``heard``: they share its node and network namespace) and a ring means the change is
    already visible: the shared-memory ``window`` (a publish is in place when it rings) and
    proposals over ``mpi`` without distributions (small messages, in the receiver's queue when the
    send returns; ``leviathan`` messages are rendezvous-sized, gloo and nccl complete on
    threads of their own)."""
    return window == "shared" and transport == "mpi" and not leviathan and neighbours <= heard


def _rank_of(addr: bytes | str | None, token: str) -> int:
    if isinstance(addr, str):
        addr = addr.encode()
    head = bell_address(token, 0)[:-1]
    if addr and addr.startswith(head):
        try:
            return int(addr[len(head) :])
        except ValueError:
            pass
    return -1


class RingingWindow:
    """A stage's epochs window that rings ``peers`` after every publish (both neighbours read a
    header); everything else is the window's own."""

    def __init__(self, window: Window, bell: Doorbell, peers: Iterable[int]) -> None:
        self.window, self.bell, self.peers = window, bell, tuple(peers)

    def publish(self, header: Header, tokens: Sequence[int], dirty_from: int) -> None:
        self.window.publish(header, tokens, dirty_from)
        for p in self.peers:
            self.bell.ring(p)

    def header(self, rank: int) -> Header:
        return self.window.header(rank)

    def snapshot(self, rank: int) -> tuple[Header, list[int]]:
        return self.window.snapshot(rank)

    def beat(self) -> None:
        self.window.beat()


class RingingSender:
    """A proposal channel's sending end that rings the receiving rank once something was posted."""

    def __init__(self, sender: Sender, bell: Doorbell, peer: int) -> None:
        self.sender, self.bell, self.peer = sender, bell, peer

    @property
    def bytes_sent(self) -> int:
        return self.sender.bytes_sent

    def try_send(
        self, prompt: int, epoch: int, start: int, tokens: list[int], dists: np.ndarray | None = None
    ) -> int:
        n = self.sender.try_send(prompt, epoch, start, tokens, dists)
        if n:
            self.bell.ring(self.peer)
        return n


class _RingsPeers:
    """What a collective's ringing port holds: the bell, and ``peers`` (the replica's other
    stages) to ring once this stage joined."""

    def __init__(self, bell: Doorbell, peers: Iterable[int]) -> None:
        self.bell, self.peers = bell, tuple(peers)

    def _ring(self) -> None:
        for p in self.peers:
            self.bell.ring(p)


class RingingGate(_RingsPeers):
    """A start gate that rings ``peers`` once this stage joined it."""

    def __init__(self, gate: Gate, bell: Doorbell, peers: Iterable[int]) -> None:
        super().__init__(bell, peers)
        self.gate = gate

    def open(self, seq: int) -> None:
        self.gate.open(seq)
        self._ring()

    def passed(self) -> bool:
        return self.gate.passed()

    def stopped(self) -> bool:
        return self.gate.stopped()


class RingingDeal(_RingsPeers):
    """A deal that rings ``peers`` once this stage asked for its slot's next job."""

    def __init__(self, deal: Deal, bell: Doorbell, peers: Iterable[int]) -> None:
        super().__init__(bell, peers)
        self.deal = deal

    def open(self) -> None:
        self.deal.open()
        self._ring()

    def dealt(self) -> int | None:
        return self.deal.dealt()


class RingingHandoff(_RingsPeers):
    """A handoff that rings ``peers`` once this stage posted its outcome (the leader waits for it)."""

    def __init__(self, handoff: Handoff, bell: Doorbell, peers: Iterable[int]) -> None:
        super().__init__(bell, peers)
        self.handoff = handoff

    def post(self, job: Job, outcome: StageOutcome) -> None:
        self.handoff.post(job, outcome)
        self._ring()

    def delivered(self) -> bool:
        return self.handoff.delivered()
