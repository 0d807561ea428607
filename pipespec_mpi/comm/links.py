"""The proposal channels by transport name: ``open_sender`` and ``open_receiver`` build the sending
and receiving class of mpi, gloo, nccl (comm/channel.py) or strict (comm/strict.py) for a link
described by a ``LinkSpec``."""

from __future__ import annotations

from pipespec_mpi.comm.channel import (
    GlooReceiver,
    GlooSender,
    LinkSpec,
    MpiReceiver,
    MpiSender,
    NcclReceiver,
    NcclSender,
    Receiver,
    Sender,
)
from pipespec_mpi.comm.strict import StrictReceiver, StrictSender

__all__ = ["RECEIVERS", "SENDERS", "LinkSpec", "open_receiver", "open_sender"]

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


def open_sender(transport: str, comm, spec: LinkSpec) -> Sender:
    """The sending side of the link ``spec`` to ``spec.peer`` over ``transport`` (mpi, gloo, nccl,
    strict); links of one pair of ranks are told apart by ``spec.tag`` (mpi, gloo: batched
    decoding's slots)."""
    return _transport_class(SENDERS, transport)(comm, spec)


def open_receiver(transport: str, comm, spec: LinkSpec) -> Receiver:
    """The receiving side of the link ``spec`` from ``spec.peer`` over ``transport`` (mpi, gloo,
    nccl, strict), for messages sent with ``spec.tag``."""
    return _transport_class(RECEIVERS, transport)(comm, spec)
