"""What a stage owes its downstream: its committed tokens from ``sent`` on and, where
distributions travel with proposals (Leviathan), each unsent token's distribution."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipespec_mpi.stage.ports import ProtocolError, Sender
from pipespec_mpi.stage.stats import StageStats


class Outbox:
    """The downstream has our tokens before ``sent``; ``rows`` holds exactly the distributions
    of the tokens still to send (position -> row)."""

    def __init__(self, stage: int, sender: Sender | None) -> None:
        self.stage, self.sender = stage, sender
        self.sent = 0
        self.rows: dict[int, np.ndarray] = {}

    def owes(self, length: int) -> bool:
        """Tokens of our ``length`` remain to be sent."""
        return self.sender is not None and self.sent < length

    def hold(self, start: int, dists: Sequence | None, n: int) -> None:
        """Keep the distributions of ``n`` tokens committed at ``start`` until they are sent."""
        if dists is None or any(d is None for d in dists[:n]):
            raise ProtocolError(f"stage {self.stage}: a token to send has no distribution")
        for k in range(n):
            self.rows[start + k] = dists[k]

    def rewind(self, sent: int, length: int) -> None:
        """Our tokens changed (a rollback or the downstream's adopted): send again from ``sent``."""
        self.sent = sent
        self.rows = {p: r for p, r in self.rows.items() if sent <= p < length}

    def adopted(self, theirs: int, length: int, epoch_changed: bool, discarded: bool) -> None:
        """After taking in the downstream's ``theirs`` tokens (ours now ``length``): it holds
        those. A new epoch of its own dropped whatever it had pending, so everything of ours
        beyond them is sent again; a rollback of ours (``discarded``) changed what follows them;
        else what was sent stays sent."""
        if epoch_changed:
            self.rewind(min(length, theirs), length)
        else:
            self.rewind(theirs if discarded else max(self.sent, theirs), length)

    def send(self, out: list[int], prompt: int, epoch: int, with_dists: bool, stats: StageStats) -> bool:
        """Send what is owed of ``out`` against the downstream's ``epoch``; False when nothing
        was (none owed, or no free send buffer)."""
        if not self.owes(len(out)):
            return False
        dists = None
        if with_dists:
            try:
                dists = np.stack([self.rows[p] for p in range(self.sent, len(out))])
            except KeyError as err:
                raise ProtocolError(
                    f"stage {self.stage}: no distribution for position {err.args[0]} to send"
                ) from None
        before = self.sender.bytes_sent
        n = self.sender.try_send(prompt, epoch, self.sent, out[self.sent :], dists)
        stats.proposed(n, self.sender.bytes_sent - before)
        for p in range(self.sent, self.sent + n):
            self.rows.pop(p, None)
        self.sent += n
        return n > 0
