"""The one table formatter of every tool (report, simulate, plan, explore, a job's benchmark
table): columns with a title and an alignment, cells already formatted by the tool, written as
aligned plain text or as Markdown, with footnotes under it.

Each tool decides what its cells say (its numbers' precision, ``-`` for a missing value: ``cell``);
this module only lays them out, so that every table of the project reads the same way and a
``--markdown`` flag means the same thing everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Column:
    title: str
    right: bool = False  # numbers are right-aligned


def cell(x: float | int | None, spec: str = "") -> str:
    """A number formatted with ``spec``; ``-`` where there is none."""
    return "-" if x is None else format(x, spec)


def text(columns: Sequence[Column], rows: Sequence[Sequence[str]], notes: Sequence[str] = ()) -> str:
    """Aligned columns two spaces apart, a rule under the titles, then the notes."""
    cells = [[c.title for c in columns], *(list(r) for r in rows)]
    for r in cells:
        if len(r) != len(columns):
            raise ValueError(f"a row has {len(r)} cells for {len(columns)} columns: {r}")
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if c.right else v.ljust(w) for v, w, c in zip(r, widths, columns, strict=True)
        ).rstrip()

    lines = [line(cells[0]), "  ".join("-" * w for w in widths), *(line(r) for r in cells[1:])]
    return "\n".join(lines + (["", *notes] if notes else []))


def markdown(columns: Sequence[Column], rows: Sequence[Sequence[str]], notes: Sequence[str] = ()) -> str:
    """A Markdown table (``|`` in a cell escaped), then the notes as lines of their own."""
    lines = ["| " + " | ".join(c.title for c in columns) + " |"]
    lines.append("|" + "|".join("---:" if c.right else "---" for c in columns) + "|")
    lines += ["| " + " | ".join(v.replace("|", "\\|") for v in r) + " |" for r in rows]
    return "\n".join(lines + ([""] + [f"{n}  " for n in notes] if notes else []))


def render(
    columns: Sequence[Column], rows: Sequence[Sequence[str]], notes: Sequence[str] = (), *, md: bool = False
) -> str:
    return (markdown if md else text)(columns, rows, notes)
