"""Start-up under a watchdog: every phase before the first prompt (rendezvous, loading, opening the
channels and windows) has ``run.startup_timeout_s``; one that overruns ends the whole job with one
message naming the phase, the rank and the job's hosts, instead of hanging with empty logs (a
multi-host gloo job whose rendezvous could not happen once sat 240 s with nothing in rank*.log).

The stall watchdog (host/wait.py) covers the decoding; this covers what comes before it. Each
phase is logged as it starts, on every rank (its rank*.log), so a slow phase is visible while it
runs, not only when it fails.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from pipespec_mpi.errors import UserError
from pipespec_mpi.run.faults import maybe_fail

log = logging.getLogger("pipespec_mpi")


class StartupError(RuntimeError):
    """A start-up phase failed (its cause chained): the phase, the rank, the hosts, a hint."""


PEER_HINT = "a peer may have died or be stuck in its own start-up; see its rank*.log"
HINTS = {  # by the phase's first word (a rendezvous' check-in: a peer that did not come)
    "rendezvous": "the ranks could not meet: check transport.iface (GLOO_SOCKET_IFNAME / "
    "NCCL_SOCKET_IFNAME), that every host reaches the first host's address and that no firewall "
    "drops the port",
}


class StartupWatchdog:
    """``with watchdog.phase("model load"): ...``: a phase that has not ended ``timeout_s`` after
    it began calls ``on_timeout(message)`` from the watchdog's thread (by default: abort the job,
    comm/bootstrap.py ``abort_job``). One thread for all phases, waiting on a condition: no
    polling, no cost while phases end in time."""

    def __init__(
        self,
        timeout_s: float,
        rank: int,
        hosts: Sequence[str],
        on_timeout: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout_s, self.rank, self.hosts = timeout_s, rank, list(hosts)
        self.on_timeout = on_timeout or _abort
        self.clock = clock
        self._cv = threading.Condition()
        self._current: tuple[str, float, float, str | None] | None = None  # (phase, deadline, limit, setting)
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name="pipespec-startup-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def phase(self, name: str, timeout_s: float | None = None, setting: str | None = None) -> Iterator[None]:
        """Watch the phase ``name`` for ``timeout_s`` (by default the watchdog's), a limit set by
        ``setting`` (named in the message; by default run.startup_timeout_s)."""
        t0 = self.clock()
        limit = self.timeout_s if timeout_s is None else timeout_s
        log.info("start-up: %s (rank %d, limit %.0f s)", name, self.rank, limit)
        with self._cv:
            self._current = (name, t0 + limit, limit, setting)
            self._cv.notify()
        try:
            maybe_fail(self.rank, name)  # PIPESPEC_INJECT_FAULT=hang@RANK:PHASE (faults.py)
            yield
        except UserError:
            raise  # already says what to fix
        except Exception as err:
            raise StartupError(self.message(name, f"failed: {err}")) from err
        finally:
            with self._cv:
                self._current = None
                self._cv.notify()
        log.info("start-up: %s done in %.1f s", name, self.clock() - t0)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()

    def message(self, name: str, what: str | None = None) -> str:
        host = self.hosts[self.rank] if self.rank < len(self.hosts) else "?"
        hint = PEER_HINT if name.endswith("check-in") else HINTS.get(name.split(" ")[0], PEER_HINT)
        what = what or f"did not end within run.startup_timeout_s={self.timeout_s:g} s"
        return (
            f"[pipespec_mpi] start-up phase '{name}' {what} on rank {self.rank} ({host}); the job's "
            f"hosts: {', '.join(sorted(set(self.hosts)))}; {hint}\n"
        )

    def _watch(self) -> None:
        with self._cv:
            while not self._closed:
                if self._current is None:
                    self._cv.wait()
                    continue
                name, deadline, limit, setting = self._current
                left = deadline - self.clock()
                if left > 0:
                    self._cv.wait(timeout=left)
                    continue
                self._current = None
                self._cv.release()
                try:
                    what = f"did not end within {limit:g} s ({setting})" if setting else None
                    self.on_timeout(self.message(name, what))
                finally:
                    self._cv.acquire()


def _abort(message: str) -> None:
    from pipespec_mpi.comm.bootstrap import abort_job

    abort_job(message, code=3)
