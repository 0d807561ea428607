"""The planner's one table: options best first, the choice marked, and optionally under the table
the command that runs each row (laid out by ``analysis/table.py``, as every tool's tables)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pipespec_mpi.analysis import table as layout
from pipespec_mpi.analysis.table import Column
from pipespec_mpi.config.schema import Policy
from pipespec_mpi.plan.options import Option, Plan

COLUMNS = (
    Column("#", right=True),
    Column("method"),
    Column("pipeline"),
    Column("win", right=True),
    Column("ahead", right=True),
    Column("batch", right=True),
    Column("ms/token", right=True),
    Column("vs AR", right=True),
    Column("choice"),
)
NOTE = (
    "ms/token of a batch: 1000 / tokens/s of all its sequences; vs AR: over AR at batch 1; "
    "win: SD's window or PipeSpec's lookahead (ad: decode.policy=adaptive); ahead: max_run_ahead"
)


def option_cells(o: Option, chosen: Option | None = None) -> list[str]:
    """One row's cells after the row number."""
    win = "-" if o.method == "ar" else "ad" if Policy(o.policy).learns else str(o.window)
    return [
        o.method,
        " -> ".join(o.pipeline),
        win,
        str(o.run_ahead) if o.run_ahead else "-",
        str(o.batch_size),
        f"{o.ms_per_token:.2f}",
        f"{o.speedup:.2f}x",
        "<- chosen" if o == chosen else "",
    ]


def format_options(
    options: Sequence[Option],
    chosen: Option | None = None,
    command: Callable[[Option], str] | None = None,
    notes: Sequence[str] = (),
) -> str:
    rows = [[str(i), *option_cells(o, chosen)] for i, o in enumerate(options, 1)]
    runs = [f"#{i}: {command(o)}" for i, o in enumerate(options, 1)] if command is not None else []
    return layout.text(COLUMNS, rows, [NOTE, *notes, *runs])


def table(
    plan: Plan, top: int = 8, per_method: bool = False, command: Callable[[Option], str] | None = None
) -> str:
    """The plan's ``top + 1`` fastest options (``per_method``: the ``top`` fastest of each method
    at batch 1), and the choice."""
    rows = [o for group in plan.best(top).values() for o in group] if per_method else plan.options[: top + 1]
    return format_options(rows, plan.chosen, command, [f"choice: {plan.reason}"])
