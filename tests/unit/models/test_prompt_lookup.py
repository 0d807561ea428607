from pipespec_mpi.models.prompt_lookup import lookup_continuation


def test_latest_match_is_used():
    seq = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert lookup_continuation(seq, 3, 2) == [7, 8]


def test_no_match_proposes_nothing():
    assert lookup_continuation([1, 2, 3, 4], 2, 5) == []


def test_limit_and_short_sequences():
    assert lookup_continuation([5, 6, 7, 5, 6], 2, 1) == [7]
    assert lookup_continuation([5], 2, 3) == []
