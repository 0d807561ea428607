"""Doorbells (host/doorbell.py): a ring wakes a waiting bell and is never lost, a full or absent
bell never blocks the ringer, ringing ports ring after the change, and the driver sleeps on a bell
that covers its stage until rung, its recheck or the quiet limit."""

from __future__ import annotations

import secrets
import threading
import time

import pytest

from pipespec_mpi.host.doorbell import (
    Doorbell,
    RingingDeal,
    RingingGate,
    RingingHandoff,
    RingingSender,
    RingingWindow,
    bell_covers,
)
from pipespec_mpi.run.drive import QUIET_MAX_S, QUIET_S, drive, quiet_limit
from pipespec_mpi.stage.loop import Step
from pipespec_mpi.stage.ports import Header
from pipespec_mpi.stage.prompt import On, Wait


@pytest.fixture
def bells():
    token = secrets.token_hex(8)
    a, b = Doorbell.open(token, 0), Doorbell.open(token, 1)
    if a is None or b is None:
        pytest.skip("no abstract unix sockets on this OS")
    yield a, b
    a.close()
    b.close()


def test_a_ring_wakes_the_wait_and_names_its_ringer(bells):
    a, b = bells
    a.ring(1)
    t0 = time.perf_counter()
    assert b.wait(5.0)
    assert time.perf_counter() - t0 < 1.0  # woken by the ring, not the timeout
    assert not b.wait(0.0)  # taken: nothing left
    a.ring(1)
    a.ring(1)
    assert b.drain() == [0, 0]


def test_a_ring_during_the_step_wakes_the_next_wait(bells):
    """The driver drains before it steps: a ring after the drain stays for the next wait."""
    a, b = bells
    assert not b.wait(0.0)
    threading.Timer(0.05, a.ring, args=(1,)).start()
    time.sleep(0.2)  # "the step"
    t0 = time.perf_counter()
    assert b.wait(5.0) and time.perf_counter() - t0 < 1.0


def test_a_wait_without_a_ring_times_out(bells):
    _, b = bells
    t0 = time.perf_counter()
    assert not b.wait(0.05)
    assert time.perf_counter() - t0 >= 0.04


def test_ringing_never_blocks_a_full_or_absent_bell(bells):
    a, b = bells
    for _ in range(1000):  # far beyond a datagram queue (net.unix.max_dgram_qlen, 10 by default)
        a.ring(1)
    a.ring(7)  # no such rank in this job
    assert b.wait(1.0)
    assert not b.wait(0.0)


def test_a_bell_of_another_job_is_not_rung():
    a, b = Doorbell.open(secrets.token_hex(8), 0), Doorbell.open(secrets.token_hex(8), 1)
    if a is None or b is None:
        pytest.skip("no abstract unix sockets on this OS")
    a.ring(1)
    assert not b.wait(0.05)
    a.close()
    b.close()


class FakeBell:
    covers = True
    collectives = True

    def __init__(self, rings=()):
        self.rung, self.waits = [], []
        self.rings = set(rings)  # the waits (by number) a ring ends

    def ring(self, rank):
        self.rung.append(rank)

    def wait(self, timeout_s):
        self.waits.append(timeout_s)
        return len(self.waits) in self.rings


class FakeWindow:
    def __init__(self, bell):
        self.bell, self.published = bell, []

    def publish(self, header, tokens, dirty_from):
        assert not self.bell.rung  # published before anyone is rung
        self.published.append((header, list(tokens)))

    def header(self, rank):
        return self.published[-1][0]

    def snapshot(self, rank):
        return self.published[-1]

    def beat(self):
        self.published.append("beat")


def test_a_ringing_window_rings_both_neighbours_after_a_publish():
    bell = FakeBell()
    win = RingingWindow(FakeWindow(bell), bell, [0, 2])
    h = Header(prompt=1, epoch=0, length=2, done=False, want=0, idle=False)
    win.publish(h, [5, 6], 0)
    assert bell.rung == [0, 2]
    assert win.header(0) == h and win.snapshot(0) == (h, [5, 6])
    win.beat()  # a heartbeat is not a change: nobody is rung
    assert bell.rung == [0, 2]


class FakeSender:
    def __init__(self, room):
        self.room, self.bytes_sent = room, 0

    def try_send(self, prompt, epoch, start, tokens, dists=None):
        n = min(self.room, len(tokens))
        self.bytes_sent += 8 * n
        return n


def test_a_ringing_sender_rings_only_what_it_posted():
    bell = FakeBell()
    snd = RingingSender(FakeSender(room=0), bell, 3)
    assert snd.try_send(0, 0, 0, [1, 2]) == 0 and bell.rung == []
    snd.sender.room = 5
    assert snd.try_send(0, 0, 0, [1, 2]) == 2 and bell.rung == [3]
    assert snd.bytes_sent == 16


@pytest.mark.parametrize(
    "window, transport, leviathan, heard, covers",
    [
        ("shared", "mpi", False, {0, 2}, True),
        ("shared", "mpi", False, {0}, False),  # a neighbour's hello never came: another node
        ("push", "mpi", False, {0, 2}, False),  # a pushed header arrives by MPI, after the ring
        ("rma", "mpi", False, {0, 2}, False),
        ("shared", "gloo", False, {0, 2}, False),  # gloo receives complete on its own thread
        ("shared", "mpi", True, {0, 2}, False),  # distributions: rendezvous-sized messages
    ],
)
def test_what_a_bell_covers(window, transport, leviathan, heard, covers):
    assert bell_covers(window, transport, leviathan, {0, 2}, heard) is covers


class FakeCollective:
    """A gate, deal and handoff at once, recording what was joined before anyone was rung."""

    def __init__(self, bell):
        self.bell, self.joined = bell, []

    def _join(self, what):
        assert not self.bell.rung  # joined before anyone is rung
        self.joined.append(what)

    def open(self, seq=None):
        self._join(("open", seq))

    def post(self, job, outcome):
        self._join(("post", job))

    def passed(self):
        return True

    def stopped(self):
        return False

    def dealt(self):
        return 4

    def delivered(self):
        return True


@pytest.mark.parametrize("port, join, wait, answer", [
    (RingingGate, lambda p: p.open(3), lambda p: (p.passed(), p.stopped()), (True, False)),
    (RingingDeal, lambda p: p.open(), lambda p: p.dealt(), 4),
    (RingingHandoff, lambda p: p.post("job", "outcome"), lambda p: p.delivered(), True),
])  # fmt: skip
def test_joining_a_collective_rings_the_replicas_other_stages(port, join, wait, answer):
    bell = FakeBell()
    inner = FakeCollective(bell)
    p = port(inner, bell, [0, 2])
    join(p)
    assert len(inner.joined) == 1 and bell.rung == [0, 2]
    assert wait(p) == answer  # waiting on it asks the collective and rings nobody
    assert bell.rung == [0, 2]


class Stepper:
    """A scripted steppable that says whether a ring covers its wait and when to recheck."""

    def __init__(self, steps, on=On.NEIGHBOUR, until=None):
        self.steps, self.on, self.until = list(steps), on, until

    def step(self):
        return self.steps.pop(0) if self.steps else Step.DONE

    def wait(self):
        return Wait(self.on, self.until)

    def describe(self):
        return "scripted stage"


def test_drive_sleeps_on_a_covering_bell_until_rung_recheck_or_quiet():
    bell = FakeBell()
    drive(Stepper([Step.WAITING] * 3), stall_timeout_s=60, bell=bell)
    assert bell.waits == [QUIET_S] * 3  # no 20 us polls: only a ring (or the safety net) wakes it
    bell.waits.clear()
    drive(Stepper([Step.WAITING] * 2, until=100.002), stall_timeout_s=60, bell=bell, clock=lambda: 100.0)
    assert bell.waits == pytest.approx([0.002, 0.002])
    bell.waits.clear()
    drive(Stepper([Step.WAITING], until=99.0), stall_timeout_s=60, bell=bell, clock=lambda: 100.0)
    assert bell.waits == [0.0]  # a recheck already due: step again at once


def test_drive_polls_with_backoff_where_the_bell_does_not_cover():
    bell = FakeBell()
    drive(Stepper([Step.WAITING] * 8, on=On.OTHER), stall_timeout_s=60, bell=bell)
    assert bell.waits == pytest.approx([20e-6, 40e-6, 80e-6, 160e-6, 320e-6, 640e-6, 1e-3, 1e-3])
    bell.waits.clear()
    bell.covers = False
    drive(Stepper([Step.WAITING, Step.PROGRESS, Step.WAITING]), stall_timeout_s=60, bell=bell)
    assert bell.waits == pytest.approx([20e-6, 20e-6])  # progress starts the backoff again


def test_drive_backs_off_to_the_quiet_limit_at_a_ringing_collective_and_polls_again_when_rung():
    bell = FakeBell(rings={11})
    drive(Stepper([Step.WAITING] * 13, on=On.COLLECTIVE), stall_timeout_s=60, bell=bell)
    doubling = [20e-6 * 2**i for i in range(9)]  # 20 us .. 5.12 ms
    assert bell.waits == pytest.approx([*doubling, QUIET_S, QUIET_S, 20e-6, 40e-6])
    bell = FakeBell()
    drive(Stepper([Step.WAITING] * 12, on=On.COLLECTIVE, until=100.002), 60, bell, lambda: 100.0)
    assert max(bell.waits) == pytest.approx(0.002)  # a slot's recheck still cuts the sleep
    bell = FakeBell()
    bell.covers = False  # rings may not come: the 1 ms polls of old
    drive(Stepper([Step.WAITING] * 9, on=On.COLLECTIVE), stall_timeout_s=60, bell=bell)
    assert max(bell.waits) == pytest.approx(1e-3)
    bell = FakeBell()
    bell.collectives = False  # a replica's stage never said hello: it may not ring as it joins
    drive(Stepper([Step.WAITING] * 9, on=On.COLLECTIVE), stall_timeout_s=60, bell=bell)
    assert max(bell.waits) == pytest.approx(1e-3)


def test_rings_inside_a_held_block_reach_each_rank_once_as_it_ends(bells):
    """``Doorbell.held``: a batched stage's slots publish one after another; their neighbour
    wakes once for all of them, when the block ends (nested blocks: the outermost)."""
    a, b = bells
    with a.held():
        a.ring(1)
        with a.held():
            a.ring(1)
            a.ring(7)  # no such rank: owed, then not reached, as outside a block
        assert not b.wait(0.0)  # nothing yet, the outer block is open
        a.ring(1)
    assert b.drain() == [0]  # one ring for the three
    a.ring(1)  # outside a block: at once
    assert b.drain() == [0]
    with pytest.raises(RuntimeError), a.held():  # an error inside the block still rings
        a.ring(1)
        raise RuntimeError("a slot failed")
    assert b.drain() == [0]


def test_the_quiet_limit_grows_with_a_waiting_steps_cost_to_keep_its_wakeups_cheap():
    """A stage whose waiting step costs more (many slots) sleeps longer without a ring: its
    safety-net wake-ups stay within a hundredth of a core, between QUIET_S and QUIET_MAX_S."""
    assert quiet_limit(0.0) == QUIET_S and quiet_limit(1e-5) == QUIET_S  # a slot or a few
    assert quiet_limit(5e-4) == pytest.approx(0.05)  # sixteen slots: half a millisecond a step
    assert quiet_limit(0.01) == QUIET_MAX_S

    now = [0.0]

    class Costly(Stepper):
        def step(self):
            now[0] += 0.002  # every step takes 2 ms of the stage clock
            return super().step()

    bell = FakeBell()
    drive(Costly([Step.WAITING] * 6), stall_timeout_s=60, bell=bell, clock=lambda: now[0])
    assert all(QUIET_S < w <= QUIET_MAX_S for w in bell.waits)
    assert bell.waits == sorted(bell.waits) and bell.waits[-1] == QUIET_MAX_S  # an average of steps
    bell.waits.clear()
    drive(Costly([Step.WAITING] * 14, on=On.COLLECTIVE), stall_timeout_s=60, bell=bell,
          clock=lambda: now[0])  # fmt: skip
    assert max(bell.waits) == QUIET_MAX_S  # a collective's backoff reaches the same limit
