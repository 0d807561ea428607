"""Batched decoding's slots over one link per neighbour pair, the slot in each message.

NCCL has no tags, so the tagged link per slot that mpi and gloo use (wire.py ``slot_tag``) would
mix the slots' messages there. On ``nccl`` (and ``strict``, which holds the protocol to NCCL's
rules) a rank has one sending and one receiving link per neighbour, in FIFO order: each slot's
``SlotSender`` posts on the pair's sender with its slot in the header, and each ``SlotReceiver``
takes its own messages from what the pair's receiver delivered (``Demux``), in the order they
came. The link is opened with a hello while both ranks connect (NCCL creates a pair's
communicator on its first operation and blocks until both ranks enter one) and closed once, by
slot 0's port, after every slot is done.
"""

from __future__ import annotations

from collections import defaultdict, deque

import numpy as np

from pipespec_mpi.comm.channel import Receiver, Sender
from pipespec_mpi.stage.ports import Proposal


class SlotSender:
    """Slot ``slot``'s sending end on the pair's link."""

    def __init__(self, link: Sender, slot: int, owner: bool | None = None) -> None:
        self.link, self.slot = link, slot
        self.owner = slot == 0 if owner is None else owner  # closes the link, after every slot
        self.bytes_sent = 0  # this slot's share of the link's bytes

    def try_send(
        self, prompt: int, epoch: int, start: int, tokens: list[int], dists: np.ndarray | None = None
    ) -> int:
        before = self.link.bytes_sent
        n = self.link.try_send(prompt, epoch, start, tokens, dists, slot=self.slot)
        self.bytes_sent += self.link.bytes_sent - before
        return n

    def close(self, wait) -> None:
        if self.owner:  # every slot is done by now
            self.link.close(wait)


class Demux:
    """The pair's receiving link, its messages sorted into each slot's queue."""

    def __init__(self, link: Receiver) -> None:
        self.link = link
        self.queues: dict[int, deque[Proposal]] = defaultdict(deque)

    def take(self, slot: int) -> list[Proposal]:
        for msg in self.link.poll():
            self.queues[msg.slot].append(msg)
        q = self.queues[slot]
        out = list(q)
        q.clear()
        return out


class SlotReceiver:
    """Slot ``slot``'s receiving end on the pair's link."""

    def __init__(self, demux: Demux, slot: int, owner: bool | None = None) -> None:
        self.demux, self.slot = demux, slot
        self.owner = slot == 0 if owner is None else owner

    def poll(self) -> list[Proposal]:
        return self.demux.take(self.slot)

    def close(self, wait) -> None:
        if self.owner:
            self.demux.link.close(wait)
