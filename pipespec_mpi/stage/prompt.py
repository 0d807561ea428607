"""What a stage keeps for the prompt it decodes, and what a waiting stage waits on.

``PromptState`` is made by ``StageLoop.reset`` for each prompt and dropped at the next: every
field the loop changes while it decodes one prompt lives here, nothing else does (the policy,
the model and the ports outlive prompts). ``Wait`` is what a stage says after a WAITING step;
how to wait for it (sleep on the doorbell, back off, poll) is the driver's (run/drive.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pipespec_mpi.speculative.sequence import Inbox
from pipespec_mpi.speculative.verifiers import Verifier
from pipespec_mpi.stage.ledger import Ledger
from pipespec_mpi.stage.outbox import Outbox
from pipespec_mpi.stage.ports import Header
from pipespec_mpi.stage.stats import StageStats, Trace


@dataclass
class PromptState:
    """One prompt on one stage, from ``reset`` (the header published) through ``begin`` (the
    prompt's tokens and rule) to ``finish``."""

    seq: int
    """The prompt's number in the replica's jobs: what headers and proposals are tagged with."""
    stats: StageStats
    trace: Trace
    outbox: Outbox
    """What the downstream is owed and has been sent."""
    epoch: int = 0
    """Our rollback epoch: bumped to make the upstream roll back to our tokens."""
    seen_down_epoch: int = 0
    """The downstream's epoch whose tokens we last adopted."""
    out: list[int] = field(default_factory=list)
    """Committed tokens (after the prompt)."""
    dirty_from: int = 0
    """The first token not yet published in the epochs window."""
    want: int = 0
    """The SD demand published in our header (tokens asked of the upstream)."""
    idle: bool = False
    """Published: nothing more to do for the downstream's tokens as they are."""
    published: tuple[int, bool, int, int] | None = None
    """The flags of the last header published (``StageLoop._flags``)."""
    down: Header | None = None
    """The downstream's header as last read (None: not read yet, or the last stage)."""
    inbox: Inbox = field(default_factory=Inbox)
    """The upstream's pending proposals beyond our tokens."""
    ledger: Ledger = field(default_factory=Ledger)
    """Which of our run-ahead the downstream judged, for the policy (stage/ledger.py)."""
    finish_reason: str | None = None
    """Why the prompt ended on this stage (None: not ended)."""
    prompt: list[int] = field(default_factory=list)
    """The prompt's token ids (``begin``)."""
    method: str = ""
    """ar | sd | pipespec (``begin``)."""
    verifier: Verifier | None = None
    """The prompt's acceptance rule (``begin``)."""
    limit: int = 0
    """This prompt's budget of new tokens (``begin``)."""

    def full(self) -> list[int]:
        """The prompt and the committed tokens."""
        return self.prompt + self.out


class On(enum.IntEnum):
    """What a waiting stage waits on, from most to least announced (a batched stage waits on
    the least announced of its slots' waits)."""

    NEIGHBOUR = 0
    """A neighbour's publish or proposal: each one rings the rank's doorbell as it lands."""
    COLLECTIVE = 1
    """A collective of its replica (the deal, the start gate, the handoff): the other stages ring
    as they join, but its completion rings nobody, so it is polled between rings."""
    OTHER = 2
    """Something no ring announces (a send buffer coming free): polled."""


@dataclass(frozen=True)
class Wait:
    """After a WAITING step: what the stage waits on, and when (its clock) to step again although
    nothing rang (the policy's recheck; None: only when something moves)."""

    on: On
    until: float | None = None

    @staticmethod
    def all(waits: list[Wait]) -> Wait:
        """The wait of a stage whose slots wait on ``waits``: the least announced, the earliest."""
        at = [w.until for w in waits if w.until is not None]
        return Wait(max((w.on for w in waits), default=On.NEIGHBOUR), min(at) if at else None)
