"""The driver of a stage on a rank: step it until DONE on a real clock, and wait without burning a
core while it waits (a neighbour's ring on the doorbell, host/doorbell.py, or backoff sleeps).

The stage says what it waits on (``Steppable.wait``: a ``Wait``, stage/prompt.py); how to wait for
it is decided here, on the CPU host. The schedule explorer drives the same
steppables its own way (simulate/explore/).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from pipespec_mpi.host.wait import Backoff, StallError
from pipespec_mpi.stage.loop import Step
from pipespec_mpi.stage.process import Steppable
from pipespec_mpi.stage.prompt import On


class Bell(Protocol):
    covers: bool  # every neighbour's change rings it by the time the change is visible
    collectives: bool  # every other stage of the replica rings it as it joins a collective

    def wait(self, timeout_s: float) -> bool:
        """Sleep until rung or ``timeout_s`` passed; take the rings."""


# How long a waiting stage whose bell covers it sleeps at most without a ring: a safety net only
# (a ring is never lost, host/doorbell.py), short enough that a missed one costs a fraction of a
# forward, long enough that the wake-ups cost next to nothing. Also the longest backoff sleep at a
# collective whose members ring: polled every millisecond, a many-slot drafter waiting through a
# phase it has no part in took CPU from the target (docs/notebook.md, "Measurements behind the
# code's choices").
QUIET_S = 0.01
# ... and where a waiting step costs more (a step over many slots), longer, up to QUIET_MAX_S, so
# that the safety net's wake-ups take at most QUIET_SHARE of a core: at a fixed limit a many-slot
# drafter woke to it more often than to rings (docs/notebook.md, "Measurements behind the code's
# choices").
QUIET_MAX_S = 0.1
QUIET_SHARE = 0.01


def drive(
    stepper: Steppable,
    stall_timeout_s: float,
    bell: Bell | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> None:
    """Step until DONE on a real clock: again at once after progress; while waiting on a
    neighbour, asleep until it rings ``bell`` (or the wait's ``until``, or the quiet limit:
    ``quiet_limit``) where the bell covers the rank; on a collective whose other stages ring when
    they join (``bell.collectives``), backoff sleeps up to the quiet limit, started again by
    every ring (a collective completes only as its members poll it, so a ring says: poll soon);
    elsewhere backoff sleeps of 20 us doubling to 1 ms, cut short by a ring; never spinning.
    ``StallError`` once nothing has moved for ``stall_timeout_s``. ``clock``: the stage clock
    ``until`` is on, and its waiting steps' cost (``quiet_limit``)."""
    backoff = Backoff()
    last = time.monotonic()
    cost = 0.0  # a waiting step's seconds (exponential average)
    while True:
        t0 = clock()
        if (s := stepper.step()) is Step.DONE:
            return
        if s is not Step.WAITING:
            backoff.reset()
            last = time.monotonic()
            continue
        cost += 0.2 * (clock() - t0 - cost)
        if time.monotonic() - last > stall_timeout_s:
            raise StallError(f"{stepper.describe()}: no progress for {stall_timeout_s:.0f} s")
        if bell is None:
            backoff.sleep()
            continue
        quiet, w = quiet_limit(cost), stepper.wait()
        if bell.covers and w.on is On.NEIGHBOUR:
            bell.wait(_until(w.until, quiet, clock))
        elif bell.covers and w.on is On.COLLECTIVE and bell.collectives:
            if bell.wait(_until(w.until, backoff.take(quiet), clock)):
                backoff.reset()
        else:
            bell.wait(backoff.take())


def quiet_limit(step_s: float) -> float:
    """The longest sleep without a ring after waiting steps of ``step_s`` seconds each: QUIET_S,
    or as long as keeps their wake-ups within QUIET_SHARE of a core, at most QUIET_MAX_S."""
    return min(QUIET_MAX_S, max(QUIET_S, step_s / QUIET_SHARE))


def _until(at: float | None, timeout_s: float, clock: Callable[[], float]) -> float:
    """``timeout_s``, cut to a wait's ``until`` (``at``, on ``clock``)."""
    return timeout_s if at is None else min(timeout_s, max(0.0, at - clock()))
