"""Proposals from upstream, held until their prompt is decoded."""

from __future__ import annotations

from collections import deque

from pipespec_mpi.stage.ports import Proposal, Receiver


class Mailbox:
    """What the upstream sent, in order. An upstream that passed the start of the next prompt
    first may already be sending for it: those are kept, not dropped."""

    def __init__(self, receiver: Receiver | None) -> None:
        self.receiver = receiver
        self.held: deque[Proposal] = deque()

    def pump(self) -> None:
        if self.receiver is not None:
            self.held.extend(self.receiver.poll())

    def take(self, seq: int) -> tuple[list[Proposal], int]:
        """This prompt's proposals, in order, and how many of older prompts were dropped.
        (A channel keeps its order and an upstream decodes prompts in order.)"""
        self.pump()
        mine, dropped = [], 0
        while self.held and self.held[0].prompt <= seq:
            msg = self.held.popleft()
            if msg.prompt == seq:
                mine.append(msg)
            else:
                dropped += 1
        return mine, dropped
