from pipespec_mpi.speculative.sequence import Inbox, adopt, adopt_sent_once, common_prefix


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


def test_a_token_sent_once_is_not_kept_beyond_the_downstream_s():
    own, theirs = [1, 2, 3, 4, 5], [1, 2, 3]  # ours agree, two beyond theirs
    a = adopt_sent_once(own, theirs, sent=3)  # none of the two was sent: still drafts to offer
    assert (a.tokens, a.keep, a.discarded) == ([1, 2, 3, 4, 5], 5, 0)
    a = adopt_sent_once(own, theirs, sent=4)  # the 4th was sent: it may have been verified there
    assert (a.tokens, a.keep, a.discarded) == ([1, 2, 3], 3, 2)
    a = adopt_sent_once([1, 9, 3, 4], [1, 2, 3], sent=4)  # a mismatch rolls back as adopt does
    assert (a.tokens, a.keep, a.discarded) == ([1, 2, 3], 1, 3) and a == adopt([1, 9, 3, 4], [1, 2, 3])


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
