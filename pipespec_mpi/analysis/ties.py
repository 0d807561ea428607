"""Greedy outputs compared as a GPU allows: every divergence at a near-tie of the target's logits.

Two greedy runs of one target (AR and a speculative method, batch 1 and batch 8) agree token for
token on a CPU, where the engine's rows are exact. On a GPU a row's logits depend on the batch and
on the kernel its shape picks, so where the target's two best logits are within rounding of each
other either run may take either token. ``check`` accepts a pair of outputs when they are equal,
or when their first divergence is at a near-tie: the gap between the top two logits of the
target's own forward at that position (after the prompt and the common prefix) at most
``epsilon``. Only the first divergence is judged: after it the runs continue from different
prefixes. ``epsilon=None`` is exact equality (CPUs): every divergence is rejected unexamined.

Pure: the target's logits come from a callable (``gap_after``); bench/gpu_check.py rescores with
the job's target, a benchmark may pass gaps it kept.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Pair:
    """Two outputs of one target for one prompt: the reference run's and another's."""

    label: str  # what is compared (e.g. "prompt 3 #0: pipespec@8 vs ar@1")
    prompt: tuple[int, ...]
    reference: tuple[int, ...]
    other: tuple[int, ...]


@dataclass(frozen=True)
class Divergence:
    """Where a pair first differs, and the target's top-2 gap there (None: not looked up)."""

    label: str
    position: int  # index into the generated tokens
    gap: float | None
    near_tie: bool


@dataclass(frozen=True)
class TieReport:
    """The verdict over many pairs: ``ok`` when every divergence is at a near-tie."""

    compared: int
    epsilon: float | None
    divergences: tuple[Divergence, ...]

    @property
    def rejected(self) -> tuple[Divergence, ...]:
        return tuple(d for d in self.divergences if not d.near_tie)

    @property
    def ok(self) -> bool:
        return not self.rejected

    def summary(self) -> str:
        """One line: pairs compared, divergences, the gaps seen and the verdict."""
        rule = "exact equality" if self.epsilon is None else f"near-tie rule, epsilon {self.epsilon:g}"
        gaps = [d.gap for d in self.divergences if d.gap is not None]
        seen = f", top-2 gaps {min(gaps):.4g}..{max(gaps):.4g}" if gaps else ""
        verdict = (
            "ok"
            if self.ok
            else f"{len(self.rejected)} REJECTED: "
            + "; ".join(
                f"{d.label} at token {d.position}" + (f" (gap {d.gap:.4g})" if d.gap is not None else "")
                for d in self.rejected[:4]
            )
        )
        return f"{self.compared} pairs ({rule}): {len(self.divergences)} diverge{seen}; {verdict}"

    def to_json(self) -> dict:
        return {
            "compared": self.compared,
            "epsilon": self.epsilon,
            "ok": self.ok,
            "divergences": [d.__dict__ for d in self.divergences],
        }


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (the shorter one's length where one is a
    proper prefix of the other: there one stopped and the other went on); None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_gap(logits: Sequence[float]) -> float:
    """The best logit minus the second best (0.0 at an exact tie)."""
    first, second = heapq.nlargest(2, logits)
    return float(first - second)


def check(
    pairs: Iterable[Pair], epsilon: float | None, gap_after: Callable[[Sequence[int]], float] | None = None
) -> TieReport:
    """Judge each pair at its first divergence: accepted where the target's top-2 gap after the
    prompt and the common prefix (``gap_after(context)``) is at most ``epsilon``; with
    ``epsilon=None`` every divergence is rejected (exact equality)."""
    if epsilon is not None and gap_after is None:
        raise ValueError("the near-tie rule needs the target's gaps (gap_after)")
    found, n = [], 0
    for p in pairs:
        n += 1
        at = first_divergence(p.reference, p.other)
        if at is None:
            continue
        gap = None if epsilon is None else gap_after([*p.prompt, *p.reference[:at]])  # type: ignore[misc]
        found.append(Divergence(p.label, at, gap, gap is not None and gap <= epsilon))  # type: ignore[operator]
    return TieReport(n, epsilon, tuple(found))


class _Output(Protocol):  # what pairs_from_records reads of a records.Record
    prompt_id: str
    sample_idx: int
    method: str
    batch_size: int
    warmup: bool
    prompt_ids: list[int]
    output_ids: list[int]


def pairs_from_records(records: Iterable[_Output], reference: str = "ar") -> list[Pair]:
    """Every counted output paired with the ``reference`` method's at the smallest batch size
    that ran it, for the same prompt and sample (a prompt without that reference is skipped)."""
    by: dict[tuple[str, int], dict[tuple[str, int], _Output]] = {}
    for r in records:
        if not r.warmup:
            by.setdefault((r.prompt_id, r.sample_idx), {})[(r.method, r.batch_size)] = r
    out = []
    for (pid, sample), runs in sorted(by.items()):
        refs = sorted(b for m, b in runs if m == reference)
        if not refs:
            continue
        ref = runs[(reference, refs[0])]
        for (method, batch), r in sorted(runs.items()):
            if (method, batch) != (reference, refs[0]):
                label = f"prompt {pid} #{sample}: {method}@{batch} vs {reference}@{refs[0]}"
                out.append(Pair(label, tuple(ref.prompt_ids), tuple(ref.output_ids), tuple(r.output_ids)))
    return out
