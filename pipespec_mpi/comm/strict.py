"""``transport.kind=strict``: gloo underneath, holding the protocol to NCCL's point-to-point rules.

NCCL forgives nothing that MPI and gloo forgive, and this machine has no GPU to show it, so the
strict transport refuses, with an error naming the rule, each thing NCCL would refuse or
silently break on:
- a tag (NCCL has none: two links between one pair of ranks cannot be told apart by it), a
  probe or a receive from any source (it has neither: this API offers them not at all);
- a pair's first operation without the peer's: NCCL creates a pair's communicator on its first
  operation and blocks until both ranks enter one (``rendezvous``: a StrictError after
  ``timeout_s``, where NCCL would hang);
- the two ranks of a pair entering its operations in different orders: NCCL runs a pair's
  operations in order on one stream, so a rank's k-th operation on the pair must meet the
  peer's k-th (every message carries its sender's index; a mismatch is a StrictError);
- a send buffer written before its send completed (NCCL reads it while the kernel runs; checked
  against a copy taken at the send);
- a received buffer read before its wait (NCCL writes it while the kernel runs; the buffer
  holds a poison value until the receive is seen complete, and reading it raises);
- a receive whose size is not its send's (NCCL needs the counts equal: a smaller message leaves
  the receive waiting for the rest, a larger one overruns it; every message carries its size).
"""

from __future__ import annotations

import datetime
import queue
import threading
from collections import defaultdict

import numpy as np
import torch

from pipespec_mpi.comm.channel import Sender, _PolledReceiver
from pipespec_mpi.comm.wire import TAG

POISON = -0x5354524943540000  # what a receive buffer holds until its receive is seen complete
_DATA, _MEET = 1, 2  # gloo tags of the wrapped messages and of the first-operation rendezvous
_HEAD = 2  # a wrapped message's header: the operation's index on the pair, the sent buffer's size


class StrictError(RuntimeError):
    """The protocol broke one of NCCL's rules (comm/strict.py)."""


class StrictP2P:
    """A rank's point-to-point operations under NCCL's rules (the transport's communicator)."""

    def __init__(self, rank: int, timeout_s: float = 120.0) -> None:
        self.rank, self.timeout_s = rank, timeout_s
        self.entered: dict[int, int] = defaultdict(int)  # per peer: operations entered on the pair
        self.met: set[int] = set()  # peers whose pair has had its first operation
        self._waiters: dict[int, queue.Queue] = {}  # per peer: receives waited on in order

    def _enter(self, peer: int, tag: int) -> int:
        """This operation's index on the pair, after the checks and the first operation's rendezvous."""
        if tag != TAG:
            raise StrictError(
                f"rank {self.rank}: an operation with peer {peer} under tag {tag}: NCCL has no tags, so "
                "two links between one pair of ranks cannot be told apart by them (one link per pair, "
                "the slot in the message: comm/mux.py)"
            )
        if peer not in self.met:
            self._rendezvous(peer)
            self.met.add(peer)
        k = self.entered[peer]
        self.entered[peer] += 1
        return k

    def _rendezvous(self, peer: int) -> None:
        import torch.distributed as dist

        mine, theirs = torch.tensor([self.rank]), torch.zeros(1, dtype=torch.int64)
        first = self.rank < peer
        try:
            if first:
                dist.isend(mine, dst=peer, tag=_MEET).wait(datetime.timedelta(seconds=self.timeout_s))
            dist.irecv(theirs, src=peer, tag=_MEET).wait(datetime.timedelta(seconds=self.timeout_s))
            if not first:
                dist.isend(mine, dst=peer, tag=_MEET).wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as err:
            raise StrictError(
                f"rank {self.rank}: the first operation with peer {peer} waited {self.timeout_s:.0f} s for "
                "the peer's: NCCL creates a pair's communicator on its first operation and blocks until "
                "both ranks enter one (have each link's sender open it with a message both ranks wait "
                f"for: comm/mux.py hello) ({err})"
            ) from err

    def isend(self, buf: torch.Tensor, peer: int, tag: int) -> StrictSend:
        return StrictSend(self, buf, peer, self._enter(peer, tag))

    def irecv(self, buf: torch.Tensor, peer: int, tag: int) -> StrictRecv:
        return StrictRecv(self, buf, peer, self._enter(peer, tag))

    def _waiter(self, peer: int) -> queue.Queue:
        """A thread that waits on ``peer``'s receives in posting order (gloo completes a receive
        only when it is waited on)."""
        if peer not in self._waiters:
            q: queue.Queue = queue.Queue()
            self._waiters[peer] = q
            threading.Thread(target=_wait_in_order, args=(q,), name=f"strict<-{peer}", daemon=True).start()
        return self._waiters[peer]


def _wait_in_order(q: queue.Queue) -> None:
    while True:
        recv = q.get()
        try:
            recv.work.wait()
        except BaseException as err:  # noqa: BLE001 - reported by the receive's owner
            recv.error = err
        recv.arrived.set()


class StrictSend:
    """A send: the buffer's contents travel as they were when it was posted (checked at completion)."""

    def __init__(self, p2p: StrictP2P, buf: torch.Tensor, peer: int, k: int) -> None:
        import torch.distributed as dist

        self.p2p, self.buf, self.peer, self.k = p2p, buf, peer, k
        self.copy = buf.clone()
        wire = torch.empty(buf.numel() + _HEAD, dtype=torch.int64)
        wire[0], wire[1] = k, buf.numel()
        wire[_HEAD:] = buf.view(-1)
        self.work = dist.isend(wire, dst=peer, tag=_DATA)
        self.done = False

    def is_completed(self) -> bool:
        if not self.done:
            self.work.wait()
            self.done = True
            if not torch.equal(self.buf, self.copy):
                raise StrictError(
                    f"rank {self.p2p.rank}: a send buffer to rank {self.peer} (operation {self.k} of the "
                    "pair) was written before its send completed: NCCL reads it while the send runs"
                )
        return True


class StrictRecv:
    """A receive into ``buf``: the buffer holds POISON until the receive is seen complete."""

    def __init__(self, p2p: StrictP2P, buf: torch.Tensor, peer: int, k: int) -> None:
        import torch.distributed as dist

        self.p2p, self.buf, self.peer, self.k = p2p, buf, peer, k
        buf.fill_(POISON)
        self.wire = torch.empty(buf.numel() + _HEAD, dtype=torch.int64)
        self.work = dist.irecv(self.wire, src=peer, tag=_DATA)
        self.arrived = threading.Event()
        self.error: BaseException | None = None
        self.done = False
        p2p._waiter(peer).put(self)

    def is_completed(self) -> bool:
        if not self.done and self.arrived.is_set():
            if self.error is not None:
                raise StrictError(
                    f"rank {self.p2p.rank}: a receive of {self.buf.numel()} words from rank {self.peer} "
                    "failed (a larger message than the receive is one way: NCCL needs the counts equal)"
                ) from self.error
            sent_as = int(self.wire[0])
            if sent_as != self.k:
                raise StrictError(
                    f"ranks {self.peer} and {self.p2p.rank} entered their pair's operations in different "
                    f"orders: rank {self.peer}'s operation {sent_as} (a send) met rank {self.p2p.rank}'s "
                    f"operation {self.k} (a receive); NCCL runs a pair's operations in order on one stream"
                )
            sent_words = int(self.wire[1])
            if sent_words != self.buf.numel():
                raise StrictError(
                    f"rank {self.peer} sent {sent_words} words (operation {self.k} of the pair) into rank "
                    f"{self.p2p.rank}'s receive of {self.buf.numel()}: NCCL needs a receive's count to be "
                    "its send's (a smaller message leaves the receive waiting, a larger one overruns it)"
                )
            self.buf.view(-1).copy_(self.wire[_HEAD:])
            self.done = True
        return self.done


def check_read(buf, peer: int, rank: int) -> None:
    """Raise where ``buf`` (a received message) still holds the poison: read before its wait."""
    if int(buf[0]) == POISON:
        raise StrictError(
            f"rank {rank}: a message from rank {peer} was read before its receive completed: NCCL "
            "writes the buffer while the receive runs"
        )


class StrictSender(Sender):
    """CPU tensors over ``comm``, a ``strict.StrictP2P`` (NCCL's rules over gloo): a message is
    encoded in place, and a buffer whose send has not completed is never sent again."""

    def _new_buffer(self, words: int):
        import torch

        return torch.zeros(words, dtype=torch.int64)

    def _host(self, i: int) -> np.ndarray:
        return self.ring.bufs[i].numpy()  # shares the tensor's memory

    def _start(self, i: int, words: int) -> tuple[object, int]:
        if self.ring.reqs[i] is not None:
            raise StrictError(f"send buffer {i} to rank {self.peer} sent again before its send completed")
        buf = self.ring.bufs[i]
        return self.comm.isend(buf, self.peer, self.tag), buf.numel()

    def _done(self, req) -> bool:
        return req.is_completed()


class StrictReceiver(_PolledReceiver):
    """Receives over ``comm``, a ``strict.StrictP2P``, polled as NCCL's are; a message read before
    its receive is seen complete is an error."""

    def _new_buffer(self, words: int):
        import torch

        return torch.zeros(words, dtype=torch.int64)

    def _post(self, i: int):
        return self.comm.irecv(self.bufs[i], self.peer, self.tag)

    def _done(self, req) -> bool:
        return req.is_completed()

    def _host(self, i: int) -> np.ndarray:
        check_read(self.bufs[i], self.peer, self.comm.rank)
        return self.bufs[i].numpy()
