"""The near-tie rule (analysis/ties.py): a divergence is accepted only where the target's own top-2
gap is within epsilon, and rejected at a wide gap; exact mode rejects every divergence."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import pytest

from pipespec_mpi.analysis.ties import Pair, check, first_divergence, pairs_from_records, top2_gap


def gaps_by_context(table: dict[tuple[int, ...], float]):
    """A target whose top-2 gap after each context is ``table``'s (and records what was asked)."""
    asked: list[tuple[int, ...]] = []

    def gap_after(context: Sequence[int]) -> float:
        asked.append(tuple(context))
        return table[tuple(context)]

    return gap_after, asked


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 7]) == 2  # one stopped where the other went on
    assert first_divergence([], []) is None


def test_top2_gap():
    assert top2_gap([0.5, 3.0, 2.75, -1.0]) == pytest.approx(0.25)
    assert top2_gap([2.0, 2.0, 1.0]) == 0.0


def test_a_divergence_at_a_near_tie_is_accepted_with_its_gap_reported():
    gap_after, asked = gaps_by_context({(9, 1, 2): 0.01})
    report = check([Pair("p", (9,), (1, 2, 3, 4), (1, 2, 5, 6))], epsilon=0.05, gap_after=gap_after)
    assert report.ok and report.compared == 1
    (d,) = report.divergences
    assert (d.position, d.gap, d.near_tie) == (2, 0.01, True)
    assert asked == [(9, 1, 2)]  # the prompt and the common prefix: only the first divergence counts
    assert "0.01" in report.summary() and report.summary().endswith("ok")


def test_a_divergence_at_a_wide_gap_is_rejected():
    gap_after, _ = gaps_by_context({(9, 1): 0.8, (9,): 0.02})
    pairs = [
        Pair("wide", (9,), (1, 2), (1, 7)),
        Pair("tie", (9,), (1, 2), (4, 2)),
        Pair("same", (9,), (3,), (3,)),
    ]
    report = check(pairs, epsilon=0.05, gap_after=gap_after)
    assert not report.ok and report.compared == 3
    assert [d.label for d in report.rejected] == ["wide"]
    assert "1 REJECTED: wide at token 1 (gap 0.8)" in report.summary()
    assert report.to_json()["ok"] is False


def test_exact_mode_rejects_any_divergence_without_asking_for_gaps():
    report = check([Pair("p", (), (1, 2), (1, 3)), Pair("q", (), (4,), (4,))], epsilon=None)
    assert not report.ok and report.rejected[0].gap is None and "exact equality" in report.summary()
    assert check([Pair("q", (), (4,), (4,))], epsilon=None).ok
    with pytest.raises(ValueError, match="gap_after"):
        check([], epsilon=0.1)


def rec(pid: str, method: str, batch: int, out: list[int], warmup: bool = False) -> SimpleNamespace:
    return SimpleNamespace(prompt_id=pid, sample_idx=0, method=method, batch_size=batch, warmup=warmup,
                           prompt_ids=[256, 7], output_ids=out)  # fmt: skip


def test_pairs_are_every_output_against_the_reference_at_the_smallest_batch():
    records = [
        rec("a", "ar", 8, [1, 2]), rec("a", "ar", 1, [1, 2]), rec("a", "sd", 1, [1, 3]),
        rec("a", "pipespec", 8, [1, 2]), rec("b", "sd", 1, [5]), rec("w", "ar", 1, [0], warmup=True),
    ]  # fmt: skip
    pairs = pairs_from_records(records)
    assert [p.label for p in pairs] == [
        "prompt a #0: ar@8 vs ar@1", "prompt a #0: pipespec@8 vs ar@1", "prompt a #0: sd@1 vs ar@1",
    ]  # fmt: skip
    assert all(p.prompt == (256, 7) and p.reference == (1, 2) for p in pairs)
    assert [d.label for d in check(pairs, epsilon=None).rejected] == ["prompt a #0: sd@1 vs ar@1"]
