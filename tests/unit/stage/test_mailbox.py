"""The mailbox keeps proposals for their prompt, in order, and drops those of finished ones."""

from __future__ import annotations

from pipespec_mpi.stage.mailbox import Mailbox
from pipespec_mpi.stage.ports import Proposal


class ListReceiver:
    def __init__(self, msgs: list[Proposal]) -> None:
        self.msgs = list(msgs)

    def poll(self) -> list[Proposal]:
        out, self.msgs = self.msgs, []
        return out


def msg(prompt: int, start: int = 0) -> Proposal:
    return Proposal(prompt, 0, start, [1])


def test_mailbox_keeps_proposals_of_a_prompt_not_started_yet():
    box = Mailbox(ListReceiver([msg(1), msg(2), msg(3, 0), msg(3, 1)]))
    box.pump()  # while waiting at the gate of prompt 2
    mine, dropped = box.take(2)
    assert [m.prompt for m in mine] == [2] and dropped == 1
    mine, dropped = box.take(3)
    assert [m.start for m in mine] == [0, 1] and dropped == 0


def test_a_mailbox_without_upstream_is_empty():
    assert Mailbox(None).take(0) == ([], 0)
