"""One link per neighbour pair for every slot (comm/mux.py): each slot's port sends with its slot
in the message, and takes its own messages in arrival order, whichever slot polls the link."""

from __future__ import annotations

from pipespec_mpi.comm.mux import Demux, SlotReceiver, SlotSender
from pipespec_mpi.stage.ports import Proposal


class FakeLink:
    """A pair's link: what is sent arrives at the next poll, in order."""

    def __init__(self) -> None:
        self.wire: list[Proposal] = []
        self.bytes_sent = 0
        self.closed = 0

    def try_send(self, prompt, epoch, start, tokens, dists=None, slot=0) -> int:
        self.wire.append(Proposal(prompt, epoch, start, list(tokens), dists, slot))
        self.bytes_sent += 8 * (5 + len(tokens))
        return len(tokens)

    def poll(self) -> list[Proposal]:
        out, self.wire = self.wire, []
        return out

    def close(self, wait) -> None:
        self.closed += 1


def test_each_slot_takes_its_own_messages_in_order():
    link = FakeLink()
    send = [SlotSender(link, s) for s in range(3)]
    demux = Demux(link)
    recv = [SlotReceiver(demux, s) for s in range(3)]
    send[1].try_send(1, 0, 5, [7, 8])
    send[0].try_send(2, 0, 3, [9])
    send[1].try_send(1, 0, 7, [10])
    assert recv[2].poll() == []  # slot 2 polled first: the others' messages wait in their queues
    assert [(p.start, p.tokens) for p in recv[1].poll()] == [(5, [7, 8]), (7, [10])]
    assert [(p.prompt, p.slot) for p in recv[0].poll()] == [(2, 0)]
    assert recv[1].poll() == []
    assert [s.bytes_sent for s in send] == [8 * 6, 8 * (7 + 6), 0]  # each slot's own share


def test_the_link_is_closed_once_by_slot_0():
    link = FakeLink()
    ports = [SlotSender(link, s) for s in range(3)] + [SlotReceiver(Demux(link), s) for s in range(2)]
    for p in ports:
        p.close(None)
    assert link.closed == 2  # the sending and the receiving end, each by its slot 0
