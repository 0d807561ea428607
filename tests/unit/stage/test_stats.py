"""A stage's counters keep their own rules: the token balance holds at every step."""

from __future__ import annotations

import pytest

from pipespec_mpi.stage.stats import CountError, StageStats, Trace


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


def test_the_trace_times_spans_from_the_prompt_start_and_waits_once():
    s = StageStats(0, 0, "m")
    tr = Trace(s, record=True)
    tr.start(10.0)
    tr.busy(10.0, 10.5, "verify", 3, context=7)
    tr.wait_from(11.0)
    tr.wait_from(11.5)  # already waiting: the wait began at 11.0
    tr.wait_ends(12.0, context=7)
    tr.wait_ends(13.0, context=7)  # no wait open: nothing counted
    tr.committed(12.25, 8)
    assert s.t0_perf_counter == 10.0 and s.busy_s == 0.5 and s.wait_s == 1.0
    assert s.timeline == [[0.0, 0.5, "verify", 3, 7], [1.0, 2.0, "wait", 0, 7]]
    assert s.commit_times == [[2.25, 8]]


def test_an_unrecorded_trace_still_counts_the_time():
    s = StageStats(0, 0, "m")
    tr = Trace(s, record=False)
    tr.start(0.0)
    tr.busy(0.0, 0.5, "own", 1, context=3)
    assert s.busy_s == 0.5 and s.timeline == []
