"""The planner's one table: options best first, the choice marked, and optionally under each row
the command that runs it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pipespec_mpi.plan.options import Option, Plan


def format_options(
    options: Sequence[Option], chosen: Option | None = None, command: Callable[[Option], str] | None = None
) -> list[str]:
    lines = [
        f"{'method':<9} {'pipeline':<58} {'win':>3} {'ahead':>5} {'batch':>5} {'ms/token':>9} {'vs AR':>7}"
    ]
    for o in options:
        mark = " <- chosen" if o == chosen else ""
        win = "-" if o.method == "ar" else "ad" if o.policy == "adaptive" else str(o.window)
        ahead = str(o.run_ahead) if o.run_ahead else "-"
        lines.append(
            f"{o.method:<9} {' -> '.join(o.pipeline):<58} {win:>3} {ahead:>5} {o.batch_size:>5} "
            f"{o.ms_per_token:>9.2f} {o.speedup:>6.2f}x{mark}"
        )
        if command is not None:
            lines.append(f"    {command(o)}")
    lines.append(
        "ms/token of a batch: 1000 / tokens/s of all its sequences; vs AR: over AR at batch 1; "
        "win: SD's window or PipeSpec's lookahead (ad: decode.policy=adaptive); ahead: max_run_ahead"
    )
    return lines


def table(
    plan: Plan, top: int = 8, per_method: bool = False, command: Callable[[Option], str] | None = None
) -> str:
    """The plan's ``top + 1`` fastest options (``per_method``: the ``top`` fastest of each method
    at batch 1), and the choice."""
    rows = [o for group in plan.best(top).values() for o in group] if per_method else plan.options[: top + 1]
    return "\n".join([*format_options(rows, plan.chosen, command), f"choice: {plan.reason}"])
