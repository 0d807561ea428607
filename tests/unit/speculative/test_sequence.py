from pipespec_mpi.speculative.sequence import Inbox, adopt, common_prefix


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


def test_adopt_rollback_to_downstream_correction():
    a = adopt([1, 2, 3, 4, 5], [1, 2, 9])
    assert a.tokens == [1, 2, 9] and a.keep == 2 and a.discarded == 3


def test_adopt_keeps_own_drafts_beyond_a_consistent_prefix():
    a = adopt([1, 2, 3, 4], [1, 2])
    assert a.tokens == [1, 2, 3, 4] and a.discarded == 0


def test_adopt_catches_up_when_downstream_is_ahead():
    a = adopt([1, 2], [1, 2, 3, 4])
    assert a.tokens == [1, 2, 3, 4] and a.keep == 2 and a.discarded == 0


def test_inbox_merge_appends_and_overlaps():
    box = Inbox()
    committed = [7, 8]
    assert box.merge(committed, 2, [1, 2])
    assert box.merge(committed, 1, [8, 1, 2, 3])  # overlap with committed and inbox
    assert box.tokens == [1, 2, 3]


def test_inbox_merge_conflict_with_committed_signals_rollback():
    box = Inbox([5])
    assert not box.merge([7, 8], 1, [9, 1])
    assert box.tokens == []


def test_inbox_merge_gap_is_rejected():
    box = Inbox()
    assert not box.merge([7], 3, [1])


def test_inbox_newer_proposal_replaces_tail():
    box = Inbox([1, 2, 3])
    assert box.merge([], 1, [5])
    assert box.tokens == [1, 5]


def test_inbox_advance_after_bonus_and_after_rejection():
    box = Inbox([1, 2, 3, 4])
    committed = [1, 2, 3]  # accepted 1, 2 then bonus/correction 3 matches the inbox
    assert box.advance(committed, 0) and box.tokens == [4]
    box = Inbox([1, 2, 3])
    assert not box.advance([1, 9], 0) and box.tokens == []
