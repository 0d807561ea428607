"""Rollback epochs in an MPI one-sided window (passive-target synchronisation).

Each rank exposes one int64 window: a header, then its committed (generated) tokens.

  header[0] prompt   sequence number of the prompt these values belong to
  header[1] epoch    bumped whenever upstream stages must roll back to this rank's tokens
  header[2] length   number of committed tokens
  header[3] done     1 when the pipeline finished this prompt (set by the last stage, relayed up)
  header[4] want     SD only: the position up to which this stage wants proposals (0 = none)
  header[5] idle     1 when this stage cannot produce more right now (cap reached, no lookup hit)

The owner writes its own window under an exclusive lock; others read under a shared lock, so a
reader always sees a header consistent with the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

HEADER = 8
PROMPT, EPOCH, LENGTH, DONE, WANT, IDLE = range(6)


@dataclass(frozen=True)
class Header:
    prompt: int
    epoch: int
    length: int
    done: bool
    want: int
    idle: bool

    @classmethod
    def of(cls, raw: np.ndarray) -> Header:
        return cls(int(raw[PROMPT]), int(raw[EPOCH]), int(raw[LENGTH]), bool(raw[DONE]),
                   int(raw[WANT]), bool(raw[IDLE]))  # fmt: skip


class EpochWindow:
    """One window over ``comm``; every rank of ``comm`` must construct (and free) it together."""

    def __init__(self, comm, max_tokens: int) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.max_tokens = max_tokens
        self.win = MPI.Win.Allocate((HEADER + max_tokens) * 8, 8, comm=comm)
        self.local = np.frombuffer(self.win.tomemory(), dtype=np.int64)
        with self.locked(self.rank, exclusive=True):
            self.local[:] = 0
            self.local[PROMPT] = -1
        self._hdr = np.empty(HEADER, dtype=np.int64)

    @contextmanager
    def locked(self, rank: int, exclusive: bool = False):
        MPI = self._MPI
        self.win.Lock(rank, MPI.LOCK_EXCLUSIVE if exclusive else MPI.LOCK_SHARED)
        try:
            yield
        finally:
            self.win.Unlock(rank)

    # -- the owner's side --------------------------------------------------------------------
    def publish(
        self,
        *,
        prompt: int,
        epoch: int,
        tokens: Sequence[int],
        dirty_from: int,
        done: bool = False,
        want: int = 0,
        idle: bool = False,
    ) -> None:
        """Write tokens[dirty_from:] and the header into this rank's window."""
        n = len(tokens)
        if n > self.max_tokens:
            raise ValueError(f"{n} committed tokens exceed the window's {self.max_tokens}")
        with self.locked(self.rank, exclusive=True):
            if dirty_from < n:
                self.local[HEADER + dirty_from : HEADER + n] = tokens[dirty_from:]
            self.local[:6] = (prompt, epoch, n, int(done), want, int(idle))

    # -- readers ------------------------------------------------------------------------------
    def header(self, rank: int) -> Header:
        MPI = self._MPI
        with self.locked(rank):
            self.win.Get(self._hdr, rank, target=(0, HEADER, MPI.INT64_T))
        return Header.of(self._hdr)

    def snapshot(self, rank: int) -> tuple[Header, list[int]]:
        """Header and all committed tokens of ``rank``, read consistently under one lock."""
        MPI = self._MPI
        with self.locked(rank):
            self.win.Get(self._hdr, rank, target=(0, HEADER, MPI.INT64_T))
            self.win.Flush(rank)  # the length is needed before the lock epoch ends
            n = int(self._hdr[LENGTH])
            buf = np.empty(max(n, 1), dtype=np.int64)
            if n:
                self.win.Get(buf[:n], rank, target=(HEADER, n, MPI.INT64_T))
        return Header.of(self._hdr), buf[:n].tolist()

    def free(self) -> None:
        if self.win is not None:
            self.local = None
            self.win.Free()
            self.win = None
