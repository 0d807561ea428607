"""The steps of torch.distributed's rendezvous (comm/bootstrap.py ``init_torch_distributed``), each
ended by one deadline: ``transport.rendezvous_timeout_s`` after the rank began the rendezvous.

1. ``check_in``: every rank tells rank 0 over MPI that it reached the rendezvous; rank 0 answers
   each with the ranks that did not (a rank that never comes is named, not waited for 30 minutes).
2. ``open_store``: rank 0 serves the TCPStore, the others connect; a connect that fails before the
   deadline is tried again (nothing was said on it yet, so a retry is safe).
3. ``mark`` / ``wait_marked``: every rank writes that it joined, and waits for every other's mark.
4. ``connect_pairs``: the backend's process group on that store, with the time left as its timeout
   (gloo connects its pairs in it), the default timeout restored afterwards for the job's operations.

A step that overruns raises ``RendezvousError`` naming the step and the ranks, with their hosts,
that did not answer. A step stuck where torch ignores its timeout is ended by the start-up
watchdog (run/startup.py), which the caller runs around each step (``step``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from pipespec_mpi.host.wait import Backoff

CHECK_IN_TAG = 0x7E11  # MPI tag of the check-in and of rank 0's answer (not used by the channels)
MARK = "pipespec/joined/{rank}"  # a rank's mark in the store


class RendezvousError(RuntimeError):
    """A rendezvous step did not end in time: the step, and who did not answer."""


@dataclass
class Deadline:
    """``limit_s`` from ``start`` (time.monotonic), as the setting named ``setting`` asks."""

    limit_s: float
    setting: str = "transport.rendezvous_timeout_s"
    start: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return max(0.0, self.start + self.limit_s - time.monotonic())

    def __str__(self) -> str:
        return f"{self.limit_s:g} s ({self.setting})"


def who(hosts: Sequence[str], ranks: Sequence[int]) -> str:
    """``rank 2 (node-b), rank 5 (node-c)``."""
    return ", ".join(f"rank {r} ({hosts[r] if r < len(hosts) else '?'})" for r in ranks)


def poll_until(cond: Callable[[], bool], seconds: float) -> bool:
    """Whether ``cond`` held within ``seconds``, polled with a sleep between tries (1 to 50 ms)."""
    end = time.monotonic() + seconds
    backoff = Backoff(1e-3, 0.05)
    while not cond():
        if time.monotonic() >= end:
            return False
        backoff.sleep()
    return True


def check_in(comm: Any, hosts: Sequence[str], deadline: Deadline, grace_s: float = 5.0) -> None:
    """Every rank of ``comm`` reached the rendezvous by ``deadline``, else ``RendezvousError``
    naming those that did not. Rank 0 collects and answers; the others wait ``grace_s`` longer
    for its answer (it is sent at rank 0's deadline) before naming rank 0."""
    rank, size = comm.Get_rank(), comm.Get_size()
    limit = str(deadline)
    if size == 1:
        return
    if rank == 0:
        pending = {r: comm.irecv(source=r, tag=CHECK_IN_TAG) for r in range(1, size)}

        def all_came() -> bool:
            for r in [r for r, req in pending.items() if req.test()[0]]:
                del pending[r]
            return not pending

        poll_until(all_came, deadline.left())
        missing = sorted(pending)
        for r in range(1, size):
            if r not in missing:
                comm.send(missing, dest=r, tag=CHECK_IN_TAG)
    else:
        comm.isend(rank, dest=0, tag=CHECK_IN_TAG)  # eager: completes whether or not 0 came
        answer = comm.irecv(source=0, tag=CHECK_IN_TAG)
        got: list = []

        def answered() -> bool:
            done, value = answer.test()
            if done:
                got.append(value)
            return done

        if not poll_until(answered, deadline.left() + grace_s):
            raise RendezvousError(f"{who(hosts, [0])} did not reach the rendezvous within {limit}")
        missing = got[0]
    if missing:
        raise RendezvousError(f"{who(hosts, missing)} did not reach the rendezvous within {limit}")


def open_store(rank: int, size: int, addr: str, port: int, hosts: Sequence[str], deadline: Deadline) -> Any:
    """Rank 0: the TCPStore's server at ``port`` (and its own client); the others: a client of it,
    connected again after a failed try until ``deadline``. Waits for no other rank (``mark``)."""
    from torch.distributed import TCPStore

    def store(timeout_s: float) -> Any:
        return TCPStore(addr, port, size, is_master=rank == 0, timeout=timedelta(seconds=timeout_s),
                        wait_for_workers=False)  # fmt: skip

    if rank == 0:
        return store(max(deadline.left(), 1.0))
    backoff, last = Backoff(0.1, 2.0), None
    while deadline.left() > 0:
        try:
            return store(max(min(deadline.left(), 10.0), 1.0))  # one try; the next after a pause
        except (RuntimeError, OSError) as err:  # refused, reset, timed out: nothing was sent
            last = err
            time.sleep(min(backoff.take(), deadline.left()))
    raise RendezvousError(
        f"{who(hosts, [rank])} could not connect to the rendezvous store of {who(hosts, [0])} at "
        f"{addr}:{port} within {deadline}: {last}"
    )


def mark(store: Any, rank: int) -> None:
    """This rank's mark: it joined the store."""
    store.set(MARK.format(rank=rank), "1")


def wait_marked(store: Any, size: int, hosts: Sequence[str], deadline: Deadline) -> None:
    """Every rank marked by ``deadline``, else ``RendezvousError`` naming the ranks that did not."""
    keys = [MARK.format(rank=r) for r in range(size)]
    try:
        store.wait(keys, timedelta(seconds=max(deadline.left(), 0.1)))
    except RuntimeError as err:  # torch's DistStoreError ("wait timeout"), or the store gone
        missing = [r for r, k in enumerate(keys) if not _has(store, k)]
        raise RendezvousError(
            f"{who(hosts, missing) or 'some rank'} did not join the rendezvous store within {deadline}: {err}"
        ) from err


def _has(store: Any, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except RuntimeError:
        return False


def connect_pairs(
    backend: str, store: Any, rank: int, size: int, hosts: Sequence[str], deadline: Deadline,
    op_timeout_s: float,
) -> None:  # fmt: skip
    """The default process group on ``store`` (gloo connects every pair here), bounded by the time
    left; afterwards its operations wait up to ``op_timeout_s`` (a receive posted ahead waits as
    long as its link idles). No ``device_id`` (NCCL's eager init): NCCL then opens a communicator
    per pair on its first operation, each pair on its own stream; one eager communicator would
    queue every pair's operations on one stream, and a receive waiting there blocks the rest."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout

    try:
        dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=size,
                                timeout=timedelta(seconds=max(deadline.left(), 1.0)))  # fmt: skip
    except RuntimeError as err:
        raise RendezvousError(
            f"the {backend} process group did not connect on {who(hosts, [rank])} within {deadline}: {err}"
        ) from err
    _set_pg_timeout(timedelta(seconds=op_timeout_s))
