"""A stage's counters keep their own rules: the token balance holds at every step."""

from __future__ import annotations

import pytest

from pipespec_mpi.stage.stats import CountError, StageStats


def test_the_token_balance_is_checked_where_tokens_change_hands():
    s = StageStats(1, 1, "m")
    s.committed(3, 3)
    s.verified(4, 2)
    s.committed(3, 6)  # two accepted and the correction
    s.adopted(keep=4, old=6, length=5, discarded_s=0.5)  # two of ours thrown away, one of theirs
    assert (s.tokens_generated, s.tokens_adopted, s.tokens_discarded, s.rollbacks) == (6, 1, 2, 1)
    assert s.token_balance(5) == 0 and s.discarded_s == 0.5 and s.verify_trace == [[4, 2]]
    s.adopted(keep=5, old=5, length=7, discarded_s=0.0)  # caught up: nothing thrown away
    assert s.rollbacks == 1 and s.tokens_adopted == 3


@pytest.mark.parametrize(
    "slip",
    [lambda s: s.committed(2, 3),  # a token counted that the stage does not hold
     lambda s: s.adopted(keep=2, old=2, length=3, discarded_s=0.0),  # told it held 2 of its 3
     lambda s: s.adopted(keep=3, old=3, length=2, discarded_s=0.0),  # kept more than it now holds
     lambda s: s.verified(2, 3)],  # more accepted than proposed
)  # fmt: skip
def test_a_bookkeeping_slip_fails_at_the_step_that_made_it(slip):
    s = StageStats(0, 0, "m")
    s.committed(3, 3)
    with pytest.raises(CountError):
        slip(s)
