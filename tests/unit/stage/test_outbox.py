"""The outbox sends what the downstream is owed and keeps exactly the unsent tokens' rows."""

from __future__ import annotations

import numpy as np
import pytest

from pipespec_mpi.stage.outbox import Outbox
from pipespec_mpi.stage.ports import ProtocolError
from pipespec_mpi.stage.stats import StageStats


class Buffers:
    """A sender with ``free`` tokens of room per call (a prefix is posted, the rest waits)."""

    def __init__(self, free: int) -> None:
        self.free, self.bytes_sent, self.sent = free, 0, []

    def try_send(self, prompt, epoch, start, tokens, dists=None) -> int:
        n = min(self.free, len(tokens))
        self.sent.append((prompt, epoch, start, tokens[:n], None if dists is None else dists[:n].copy()))
        self.bytes_sent += 4 * n
        return n


def rows(n: int, v: int = 3) -> list[np.ndarray]:
    return [np.full(v, i, dtype=np.float32) for i in range(n)]


def test_rows_travel_with_their_tokens_and_are_dropped_once_sent():
    sender, stats = Buffers(free=2), StageStats(0, 0, "m")
    box = Outbox(0, sender)
    box.hold(0, rows(3), 3)
    assert box.send([5, 6, 7], prompt=1, epoch=0, with_dists=True, stats=stats)
    assert box.sent == 2 and set(box.rows) == {2}  # the third waits for a buffer, its row kept
    assert box.send([5, 6, 7], prompt=1, epoch=0, with_dists=True, stats=stats)
    assert box.sent == 3 and box.rows == {} and not box.owes(3)
    assert [s[2:4] for s in sender.sent] == [(0, [5, 6]), (2, [7])]
    assert sender.sent[1][4][0, 0] == 2  # the third token's own row
    assert stats.tokens_proposed == 3 and stats.bytes_sent == 12
    assert not box.send([5, 6, 7], prompt=1, epoch=0, with_dists=True, stats=stats)  # nothing owed


def test_a_token_to_send_without_its_distribution_is_a_protocol_error():
    box = Outbox(0, Buffers(free=4))
    with pytest.raises(ProtocolError, match="no distribution"):
        box.hold(0, [None], 1)
    box.hold(0, rows(1), 1)
    box.rewind(0, 2)  # two tokens owed, the second's row never held (a resend it cannot make)
    with pytest.raises(ProtocolError, match="position 1"):
        box.send([5, 6], prompt=1, epoch=0, with_dists=True, stats=StageStats(0, 0, "m"))


def test_a_rewind_keeps_only_the_rows_of_tokens_still_to_send():
    box = Outbox(0, Buffers(free=0))
    box.hold(0, rows(5), 5)
    box.rewind(2, 4)  # the downstream holds 2 of ours; we now hold 4
    assert set(box.rows) == {2, 3} and box.owes(4)


def test_the_last_stage_owes_nothing():
    box = Outbox(2, None)
    assert not box.owes(5)
    assert not box.send([1, 2], prompt=0, epoch=0, with_dists=False, stats=StageStats(2, 2, "m"))


def test_after_an_adoption_what_the_downstream_holds_is_sent_and_the_rest_again_where_it_changed():
    box = Outbox(0, Buffers(8))
    box.sent = 6
    box.adopted(theirs=4, length=7, epoch_changed=False, discarded=False)  # it caught up: nothing new
    assert box.sent == 6
    box.adopted(theirs=7, length=7, epoch_changed=False, discarded=False)  # it holds more than we sent
    assert box.sent == 7
    box.sent = 6
    box.adopted(theirs=4, length=5, epoch_changed=False, discarded=True)  # ours rolled back after its 4
    assert box.sent == 4
    box.sent = 6
    box.adopted(theirs=3, length=6, epoch_changed=True, discarded=False)  # its new epoch dropped 4..5
    assert box.sent == 3
    box.adopted(theirs=9, length=6, epoch_changed=True, discarded=False)  # never beyond ours
    assert box.sent == 6
