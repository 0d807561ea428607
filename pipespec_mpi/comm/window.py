"""Rollback epochs in an MPI one-sided window (passive-target synchronisation).

Each rank exposes one int64 window: a header, then its committed (generated) tokens.

  header[0] prompt   sequence number of the prompt these values belong to
  header[1] epoch    bumped whenever upstream stages must roll back to this rank's tokens
  header[2] length   number of committed tokens
  header[3] done     1 when the pipeline finished this prompt (set by the last stage, relayed up)
  header[4] want     SD only: the position up to which this stage wants proposals (0 = none)
  header[5] idle     1 when this stage cannot produce more right now (cap reached, no lookup hit)
  header[6] down_epoch, header[7] down_length: the downstream's epoch and committed length as
            this stage had read them (what its idle flag is about)

Three implementations with one interface:

``SharedEpochWindow`` (the default when every pipeline sits on one node): ``MPI.Win.Allocate_shared``
on the node; readers load the owner's segment directly, consistency by a sequence lock (header[7]
odd while the owner writes; a reader retries on a change). A read never waits for the owner.

``EpochWindow`` (pipelines across nodes): ``MPI.Win.Allocate`` with passive-target Lock / Get /
Unlock. Under MPICH a Get is only served when the owner enters MPI, so a read can wait for the
owner's current forward, up to a forward's length against a busy owner (docs/notebook.md,
"Measurements behind the code's choices"). Hence the shared window wherever it applies.

``PushedEpochWindow`` (the default across nodes): the owner pushes every header it publishes, with
the tokens changed since the last one, to the neighbours that read it, as non-blocking messages;
a read drains what has arrived and returns the newest copy. A read never waits for the owner, only
for the network: it sees a version published one message latency ago, which is what the other two
windows give a reader a moment later anyway (the schedule explorer's window returns any version not
older than the last one seen, which covers it). Messages between two ranks are not overtaken
(MPI's ordering), so the copies go through the owner's versions in order.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from contextlib import contextmanager

import numpy as np

from pipespec_mpi.errors import UserError
from pipespec_mpi.stage.ports import Header

HEADER = 10
PROMPT, EPOCH, LENGTH, DONE, WANT, IDLE, DOWN_EPOCH, DOWN_LENGTH = range(8)
FIELDS = DOWN_LENGTH + 1  # the words a publish writes (Header's fields, in this order)
BEAT = 8  # heartbeat: the owner's CLOCK_MONOTONIC in ms, refreshed by every loop and wait
SEQ = 9  # sequence lock of the shared window


class OneSidedUnavailable(UserError):
    """This MPI cannot make the epochs windows (the job stops before any model loads)."""


def check_one_sided(kind: str) -> None:
    """Raise ``OneSidedUnavailable`` where this MPI lacks the one-sided windows ``run.epochs_window``
    needs: MPI-3 RMA (``MPI_Win_allocate``; shared memory: ``MPI_Win_allocate_shared``), tried on
    this rank alone."""
    from mpi4py import MPI

    need = ["Allocate_shared", "Allocate"] if kind in ("auto", "shared") else ["Allocate"]
    for name in need:
        try:
            win = getattr(MPI.Win, name)(8, 8, comm=MPI.COMM_SELF)
            win.Free()
        except (AttributeError, NotImplementedError, MPI.Exception) as err:
            lib = MPI.Get_library_version().splitlines()[0].strip()
            raise OneSidedUnavailable(
                f"run.epochs_window={kind} needs MPI-3 one-sided windows (MPI_Win_{name.lower()}), which "
                f"this MPI cannot make ({lib}: {type(err).__name__}: {err}): load an MPI-3 library "
                "(module load openmpi/4 or newer, MPICH 3 or newer) and rebuild mpi4py against it "
                "(bash scripts/setup.sh --site-mpi), or use the MPICH wheel (bash scripts/setup.sh)"
            ) from err


def now_ms() -> int:
    return time.monotonic_ns() // 1_000_000


def read_header(raw: np.ndarray) -> Header:
    """The header fields of a window's raw int64 words."""
    return Header(int(raw[PROMPT]), int(raw[EPOCH]), int(raw[LENGTH]), bool(raw[DONE]),
                  int(raw[WANT]), bool(raw[IDLE]), int(raw[DOWN_EPOCH]), int(raw[DOWN_LENGTH]))  # fmt: skip


def header_words(h: Header) -> tuple[int, ...]:
    """The ``FIELDS`` words a publish writes: ``read_header``'s inverse."""
    return (h.prompt, h.epoch, h.length, int(h.done), h.want, int(h.idle), h.down_epoch, h.down_length)


def _checked(h: Header, tokens: Sequence[int], max_tokens: int) -> None:
    if h.length != len(tokens):
        raise ValueError(f"a header of length {h.length} published with {len(tokens)} tokens")
    if h.length > max_tokens:
        raise ValueError(f"{h.length} committed tokens exceed the window's {max_tokens}")


def write_state(
    local: np.ndarray, max_tokens: int, header: Header, tokens: Sequence[int], dirty_from: int
) -> None:
    """Store tokens[dirty_from:] and the header fields into a window's local memory."""
    _checked(header, tokens, max_tokens)
    n = len(tokens)
    if dirty_from < n:
        local[HEADER + dirty_from : HEADER + n] = tokens[dirty_from:]
    local[:FIELDS] = header_words(header)


class EpochWindow:
    """One window over ``comm``; every rank of ``comm`` must construct (and free) it together."""

    kind = "rma"

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
            self.local[BEAT] = now_ms()
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
    def publish(self, header: Header, tokens: Sequence[int], dirty_from: int) -> None:
        """Write tokens[dirty_from:] and the header into this rank's window."""
        with self.locked(self.rank, exclusive=True):
            write_state(self.local, self.max_tokens, header, tokens, dirty_from)

    # -- readers ------------------------------------------------------------------------------
    def header(self, rank: int) -> Header:
        MPI = self._MPI
        with self.locked(rank):
            self.win.Get(self._hdr, rank, target=(0, HEADER, MPI.INT64_T))
        return read_header(self._hdr)

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
        return read_header(self._hdr), buf[:n].tolist()

    def beat(self) -> None:
        """Refresh this rank's heartbeat (a single aligned int64 store)."""
        self.local[BEAT] = now_ms()

    def heartbeat_age_s(self, rank: int) -> float:
        MPI = self._MPI
        with self.locked(rank):
            self.win.Get(self._hdr, rank, target=(0, HEADER, MPI.INT64_T))
        return (now_ms() - int(self._hdr[BEAT])) / 1000

    def free(self) -> None:
        if self.win is not None:
            self.local = None
            self.win.Free()
            self.win = None


class SharedEpochWindow:
    """Node-local epochs window: direct loads from the owner's shared segment, never blocking.

    Every rank of ``node_comm`` must construct (and free) it together, each passing its own
    ``world_rank``: the ranks gather them, so that ``header(rank)`` and ``snapshot(rank)`` take world
    ranks (each one's segment is found by its rank in ``node_comm``).
    """

    kind = "shared"

    def __init__(self, node_comm, max_tokens: int, world_rank: int) -> None:
        from mpi4py import MPI

        self.max_tokens = max_tokens
        self.win = MPI.Win.Allocate_shared((HEADER + max_tokens) * 8, 8, comm=node_comm)
        self.win.Lock_all(MPI.MODE_NOCHECK)  # a passive epoch so that Sync() is a memory barrier
        node_of = node_comm.allgather(world_rank)
        self._views = {}
        for node_rank, wr in enumerate(node_of):
            buf, _ = self.win.Shared_query(node_rank)
            self._views[wr] = np.frombuffer(buf, dtype=np.int64, count=HEADER + max_tokens)
        self.local = self._views[world_rank]
        self.local[:] = 0
        self.local[PROMPT] = -1
        self.local[BEAT] = now_ms()
        self.win.Sync()
        node_comm.Barrier()

    def publish(self, header: Header, tokens: Sequence[int], dirty_from: int) -> None:
        loc = self.local
        loc[SEQ] += 1  # odd: writing
        self.win.Sync()
        write_state(loc, self.max_tokens, header, tokens, dirty_from)
        self.win.Sync()
        loc[SEQ] += 1  # even: consistent

    def _read(self, rank: int, with_tokens: bool) -> tuple[np.ndarray, np.ndarray | None]:
        view = self._views[rank]
        while True:
            s1 = int(view[SEQ])
            if s1 % 2 == 0:
                self.win.Sync()
                hdr = view[:HEADER].copy()
                toks = view[HEADER : HEADER + int(hdr[LENGTH])].copy() if with_tokens else None
                self.win.Sync()
                if int(view[SEQ]) == s1:
                    return hdr, toks
            time.sleep(0)  # the owner is mid-write (microseconds): yield and retry

    def header(self, rank: int) -> Header:
        return read_header(self._read(rank, False)[0])

    def beat(self) -> None:
        """Refresh this rank's heartbeat (a single aligned int64 store, outside the seqlock)."""
        self.local[BEAT] = now_ms()

    def heartbeat_age_s(self, rank: int) -> float:
        return (now_ms() - int(self._views[rank][BEAT])) / 1000

    def snapshot(self, rank: int) -> tuple[Header, list[int]]:
        hdr, toks = self._read(rank, True)
        return read_header(hdr), toks.tolist()

    def free(self) -> None:
        if self.win is not None:
            self._views = {}
            self.local = None
            self.win.Unlock_all()
            self.win.Free()
            self.win = None


PUSH_TAG = 1  # on the window's own (duplicated) communicator


class PushedEpochWindow:
    """Epochs across nodes: every publish is pushed to the neighbours that read this rank.

    ``readers``: the ranks that read this one (its pipeline neighbours); ``sources``: the ranks
    this one reads. Every rank of ``comm`` must construct (and free) it together. A message is
    int64 ``[header[:HEADER], dirty_from, tokens[dirty_from:]]``; to a rank that only reads the
    header (the downstream reads its upstream's idle flag) the tokens are left out. Heartbeats
    stay in an RMA window (read only to name a stalled peer, so a slow read costs nothing).
    """

    kind = "push"

    def __init__(
        self,
        comm,
        max_tokens: int,
        readers: Iterable[int],
        sources: Iterable[int],
        header_only: Iterable[int] = (),
    ) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self.max_tokens = max_tokens
        self.comm = comm.Dup()
        self.readers = sorted(set(readers))
        self.header_only = set(header_only)
        self.beats = EpochWindow(comm, 0)
        self._sends: list = []  # (request, buffer): a buffer lives until its send completes
        self._status = MPI.Status()
        self._copies: dict[int, tuple[np.ndarray, list[int]]] = {}
        for r in sources:
            blank = np.zeros(HEADER, dtype=np.int64)
            blank[PROMPT] = -1
            self._copies[r] = (blank, [])
        self._buf = np.empty(HEADER + 1 + max_tokens, dtype=np.int64)

    # -- the owner's side --------------------------------------------------------------------
    def publish(self, header: Header, tokens: Sequence[int], dirty_from: int) -> None:
        _checked(header, tokens, self.max_tokens)
        n = len(tokens)
        self._reap()
        dirty_from = min(dirty_from, n)
        full = np.empty(HEADER + 1 + n - dirty_from, dtype=np.int64)
        full[:FIELDS] = header_words(header)
        full[BEAT], full[SEQ], full[HEADER] = now_ms(), 0, dirty_from
        full[HEADER + 1 :] = tokens[dirty_from:]
        for r in self.readers:
            buf = full[: HEADER + 1] if r in self.header_only else full
            self._sends.append((self.comm.Isend(buf, r, PUSH_TAG), buf))

    def _reap(self) -> None:
        if self._sends:
            self._sends = [(req, buf) for req, buf in self._sends if not req.Test()]

    # -- readers ------------------------------------------------------------------------------
    def _drain(self, rank: int) -> tuple[np.ndarray, list[int]]:
        """Apply every message that has arrived from ``rank``, in order; the newest copy."""
        MPI, st = self._MPI, self._status
        hdr, toks = self._copies[rank]
        while self.comm.Iprobe(rank, PUSH_TAG, st):
            count = st.Get_count(MPI.INT64_T)
            if count == 1:
                break  # the end marker: free() takes it
            buf = self._buf[:count]
            self.comm.Recv(buf, rank, PUSH_TAG)
            hdr = buf[:HEADER].copy()
            dirty_from, n = int(buf[HEADER]), int(hdr[LENGTH])
            if count > HEADER + 1 or dirty_from >= n:  # header-only copies keep no tokens
                toks = toks[:dirty_from] + buf[HEADER + 1 : count].tolist()
                del toks[n:]
        self._copies[rank] = (hdr, toks)
        return hdr, toks

    def header(self, rank: int) -> Header:
        return read_header(self._drain(rank)[0])

    def snapshot(self, rank: int) -> tuple[Header, list[int]]:
        hdr, toks = self._drain(rank)
        if len(toks) != int(hdr[LENGTH]):
            raise RuntimeError(f"rank {rank}'s tokens were not pushed here (a header-only reader)")
        return read_header(hdr), list(toks)

    def beat(self) -> None:
        self.beats.beat()

    def heartbeat_age_s(self, rank: int) -> float:
        return self.beats.heartbeat_age_s(rank)

    def free(self) -> None:
        """Close the pushes: send each reader a one-element end marker, take in everything up
        to each source's marker (messages between two ranks keep their order), free."""
        if self.comm is None:
            return
        MPI, st = self._MPI, self._status
        end = np.full(1, -1, dtype=np.int64)
        self._sends += [(self.comm.Isend(end, r, PUSH_TAG), end) for r in self.readers]
        for r in self._copies:
            while True:
                self.comm.Probe(r, PUSH_TAG, st)
                if st.Get_count(MPI.INT64_T) == 1:
                    self.comm.Recv(end[:1].copy(), r, PUSH_TAG)
                    break
                self._drain(r)
        MPI.Request.Waitall([req for req, _ in self._sends])
        self._sends = []
        self.beats.free()
        self.comm.Free()
        self.comm = None
