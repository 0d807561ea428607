"""Which of a phase's jobs a slot decodes next: dealt in order, or from one queue its slots share.

A phase's jobs (one method, one batch size) are decoded by its B slots. Dealt in turn (slot s the
s-th, (s+B)-th, ... job) a slot that drew short answers idles at the end of the phase while another
still has two long ones to go. A shared queue hands the next job to whichever slot asks first,
so no slot idles while a job is left. Every stage of a slot must decode the same job, and the
slots of different stages ask in different orders, so one stage decides: the last stage's slots
share the queue (it learns first that a prompt is finished), and each of its slots tells the
other stages of that slot which job it took (``Deal``: an MPI vote, the explorer's port).

Which slot decodes which prompt follows timing, and can never change an output: each prompt is
decoded by the protocol of one sequence whichever slot runs it, with its own sampling key.
"""

from __future__ import annotations

from typing import Protocol

END = -1  # dealt: no job is left for this slot


class Deal(Protocol):
    """How a slot learns its next job; the stages of one slot see the same answers in order."""

    def open(self) -> None:
        """This stage's slot has finished its job (or not started any) and wants the next."""

    def dealt(self) -> int | None:
        """After ``open``: None while the slot's stages have not agreed yet (never blocks); then
        the job's index in the phase's list, or ``END``."""


class JobQueue:
    """Indices 0..n-1 handed out in order, each once."""

    def __init__(self, n: int) -> None:
        self.n, self.next = n, 0

    def claim(self) -> int:
        if self.next >= self.n:
            return END
        self.next += 1
        return self.next - 1


class InTurn:
    """A slot's own jobs, decided without asking anyone: ``slot``, ``slot + slots``, ... of ``n``
    (one slot: every job in order; every stage deals the same)."""

    def __init__(self, n: int, slot: int = 0, slots: int = 1) -> None:
        self.order = list(range(slot, n, slots))
        self.i = -1

    def open(self) -> None:
        self.i += 1

    def dealt(self) -> int | None:
        return self.order[self.i] if self.i < len(self.order) else END
