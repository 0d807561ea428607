"""Waiting without burning a core: poll, then sleep with exponential backoff.

MPICH's blocking calls spin; on a CPU node where ranks share cores a spinning rank steals its
neighbour's compute. Every wait in this package polls a condition and sleeps between polls
(20 us doubling to 1 ms), and gives up with ``StallError`` after a deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class StallError(TimeoutError):
    pass


class Backoff:
    def __init__(self, min_s: float = 20e-6, max_s: float = 1e-3) -> None:
        self.min_s, self.max_s = min_s, max_s
        self.delay = min_s

    def reset(self) -> None:
        self.delay = self.min_s

    def take(self, max_s: float | None = None) -> float:
        """The next delay (each one twice the last, up to ``max_s``: this call's, else the
        backoff's own)."""
        cap = self.max_s if max_s is None else max_s
        d = min(self.delay, cap)
        self.delay = min(cap, self.delay * 2)
        return d

    def sleep(self) -> float:
        d = self.take()
        time.sleep(d)
        return d


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``cond`` with backoff until it holds; raise StallError naming ``what`` on timeout."""
    if cond():
        return
    backoff = Backoff()
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise StallError(f"no progress for {timeout_s:.0f} s while waiting for {what}")
        backoff.sleep()


def sleep_at_barrier(comm) -> None:
    """A barrier waited for by sleeping, without a deadline (a start-up phase's watchdog or the
    job's end bounds it): while the other ranks load their models, while rank 0 measures, and on a
    spare rank until the job ends (hours, maybe). MPICH's collectives spin while they wait, which
    takes cores from the ranks loading and slows and skews rank 0's timings (docs/notebook.md,
    "Measurements behind the code's choices")."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.05)
