import pytest
import torch

from pipespec_mpi.speculative.greedy import accept, greedy_verify


def logits_for(ids: list[int], vocab: int = 10) -> torch.Tensor:
    """Logits [len(ids), vocab] whose argmax row by row is ``ids``."""
    out = torch.zeros(len(ids), vocab)
    for i, t in enumerate(ids):
        out[i, t] = 1.0
    return out


def test_perfect_match_gives_bonus():
    v = greedy_verify([1, 2, 3], logits_for([1, 2, 3, 7]))
    assert (v.n_accepted, v.next_token, v.rejected) == (3, 7, False)
    assert v.committed([1, 2, 3]) == [1, 2, 3, 7]


def test_early_mismatch_gives_recovered_token():
    v = greedy_verify([1, 2, 3], logits_for([1, 5, 3, 7]))
    assert (v.n_accepted, v.next_token, v.rejected) == (1, 5, True)
    assert v.committed([1, 2, 3]) == [1, 5]


def test_first_token_rejected():
    v = greedy_verify([4], logits_for([9, 0]))
    assert v.committed([4]) == [9] and v.n_accepted == 0


def test_empty_proposal_is_an_own_step():
    v = greedy_verify([], logits_for([6]))
    assert v.committed([]) == [6] and not v.rejected


def test_later_match_after_mismatch_does_not_count():
    got = accept(torch.tensor([[1, 9, 3]]), torch.tensor([3]), torch.tensor([[1, 2, 3, 4]]))
    assert got.tolist() == [[1, 2]]


def test_many_verdicts_at_once_padding_never_counts():
    """B verifications in one call: padded proposal entries are not accepted even where they
    happen to equal the target (row 2: a real count of 1)."""
    proposal = torch.tensor([[1, 2, 3], [5, 6, 0], [7, 8, 9], [0, 0, 0]])
    count = torch.tensor([3, 2, 1, 0])
    target = torch.tensor([[1, 2, 3, 4], [5, 1, 0, 0], [7, 8, 9, 9], [3, 0, 0, 0]])
    assert accept(proposal, count, target).tolist() == [[3, 4], [1, 1], [1, 8], [0, 3]]


def test_ties_resolve_to_lowest_id():
    assert greedy_verify([], torch.tensor([[0.5, 2.0, 2.0]])).next_token == 1


def test_wrong_logit_rows_rejected():
    with pytest.raises(ValueError, match="n\\+1"):
        greedy_verify([1, 2], logits_for([1, 2]))
