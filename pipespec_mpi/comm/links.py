"""The proposal channels by transport name: ``open_sender`` and ``open_receiver`` build the sending
and receiving class of mpi, gloo, nccl (comm/channel.py) or strict (comm/strict.py)."""

from __future__ import annotations

from pipespec_mpi.comm.channel import (
    GlooReceiver,
    GlooSender,
    MpiReceiver,
    MpiSender,
    NcclReceiver,
    NcclSender,
    Receiver,
    Sender,
)
from pipespec_mpi.comm.strict import StrictReceiver, StrictSender
from pipespec_mpi.comm.wire import TAG

SENDERS: dict[str, type[Sender]] = {
    "mpi": MpiSender,
    "gloo": GlooSender,
    "nccl": NcclSender,
    "strict": StrictSender,
}
RECEIVERS: dict[str, type[Receiver]] = {
    "mpi": MpiReceiver,
    "gloo": GlooReceiver,
    "nccl": NcclReceiver,
    "strict": StrictReceiver,
}


def _transport_class(table: dict, transport: str) -> type:
    if transport not in table:
        raise ValueError(f"unknown transport {transport!r}: one of {', '.join(table)}")
    return table[transport]


def open_sender(
    transport: str,
    comm,
    peer: int,
    depth: int,
    max_msg_tokens: int,
    device=None,
    dist_width: int = 0,
    tag: int = TAG,
) -> Sender:
    """The sending side of a link to ``peer`` over ``transport`` (mpi, gloo, nccl); links of one
    pair of ranks are told apart by ``tag`` (mpi, gloo: batched decoding's slots)."""
    return _transport_class(SENDERS, transport)(comm, peer, depth, max_msg_tokens, device, dist_width, tag)


def open_receiver(
    transport: str,
    comm,
    peer: int,
    depth: int,
    max_msg_tokens: int,
    device=None,
    dist_width: int = 0,
    tag: int = TAG,
) -> Receiver:
    """The receiving side of a link from ``peer`` over ``transport`` (mpi, gloo, nccl), for
    messages sent with ``tag``."""
    return _transport_class(RECEIVERS, transport)(comm, peer, depth, max_msg_tokens, device, dist_width, tag)
