"""One search for every planner: every candidate pipeline of a ``Source`` with every setting of
the ``Grid``, predicted, ranked, and the choice (speculation only where it is predicted to beat
AR by the margin).

A source says what the prediction is made from: measured costs and agreement on this node
(``MeasuredSource``: ``hierarchy=auto``, ``pipespec-plan --measure``), or latency profiles and
pairwise rates (``RateSource``: a plan file, a past run's fit, the paper's setting). Batched
(``Grid.batch_sizes``): AR at every size, and each pipeline and method's best batch-1 setting at
every size; the choice is then by throughput against the best batched AR.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Protocol

from pipespec_mpi.config import DecodeConfig
from pipespec_mpi.plan.options import Grid, Option, Plan, Setting


class Source(Protocol):
    """What a plan is computed from."""

    target: str
    threads: Mapping[int, int]  # stages -> threads per rank (where the source knows them)

    def pipelines(self, max_stages: int) -> list[tuple[str, ...]]:
        """Candidate pipelines of 2..max_stages stages (names, the target last) it can predict."""

    def ms(self, pipeline: tuple[str, ...], setting: Setting, decode: DecodeConfig) -> float:
        """Predicted ms/token of ``pipeline`` decoding under ``setting`` applied to ``decode``."""


def search(source: Source, decode: DecodeConfig, grid: Grid, max_stages: int, margin: float = 0.0) -> Plan:
    """Predict every (pipeline, setting) and choose (see the module's docstring)."""
    target = (source.target,)
    ar_ms = source.ms(target, Setting("ar"), decode)
    ars = [Option("ar", target, 0, ar_ms, 1.0)]
    for b in sorted(set(grid.batch_sizes) - {1}):
        ars.append(
            Option.of(
                Setting("ar", batch_size=b),
                target,
                source.ms(target, Setting("ar", batch_size=b), decode),
                ar_ms,
            )
        )
    ar = min(ars, key=lambda o: o.ms_per_token)
    options = []
    settings = grid.settings(decode)
    for p in source.pipelines(max_stages):
        for st in settings:
            options.append(Option.of(st, p, source.ms(p, st, decode), ar_ms))
    options.sort(key=lambda o: o.ms_per_token)
    batched = []
    for b in sorted(set(grid.batch_sizes) - {1}):
        tops: dict[tuple, Option] = {}
        for o in options:  # each (pipeline, method)'s best setting at batch 1
            tops.setdefault((o.pipeline, o.method), o)
        for o in tops.values():
            st = replace(o.setting, batch_size=b)
            batched.append(Option.of(st, o.pipeline, source.ms(o.pipeline, st, decode), ar_ms))
    options = sorted(options + batched, key=lambda o: o.ms_per_token)
    best = options[0] if options else None
    # with batch sizes to choose from, throughputs are compared: the best AR is at its best size
    by_throughput = len(ars) > 1
    vs = f"the best AR's throughput (batch {ar.batch_size})" if by_throughput else "AR"
    at = lambda o: f" at batch {o.batch_size}" if by_throughput else ""  # noqa: E731
    if best is not None and best.ms_per_token * (1 + margin) <= ar.ms_per_token:
        gain = ar.ms_per_token / best.ms_per_token
        chosen = best
        reason = f"predicted {gain:.2f}x {vs}" + (f" with {best.method}{at(best)}" if by_throughput else "")
        reason += f" (>= 1 + margin {margin})"
    else:
        chosen = ar
        reason = (
            f"no speculative option is predicted to beat {vs} by the margin {margin} "
            f"(best: {best.method} {' -> '.join(best.pipeline)}{at(best)} at "
            f"{ar.ms_per_token / best.ms_per_token:.2f}x)"
            if best
            else "no speculative option to simulate (no drafter proposes along the calibration paths)"
        )
    options_all = sorted([*ars, *options], key=lambda o: o.ms_per_token)
    if len(ars) == 1:
        options_all = [ar, *options]  # batch 1 alone: AR first, as the table has always shown it
    return Plan(chosen, best, ar, margin, reason, tuple(options_all), dict(source.threads))
