"""The generated references: docs/config.md (``config.reference.config_reference``) and
docs/outputs-fields.md (``outputs_reference``: the fields of a run directory's files, read from
records.py and stage/stats.py as config/reference.py reads the configuration).

  python -m pipespec_mpi.analysis.reference --write   (re)writes both
  python -m pipespec_mpi.analysis.reference --check   exits 1, naming each file that is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipespec_mpi.config.reference import COMMAND, GENERATED, config_reference, field_table, heading_text
from pipespec_mpi.records import (
    BENCHMARK,
    RESULTS,
    SUMMARY,
    BenchmarkRow,
    MethodSummary,
    PairAcceptance,
    Record,
    SpeedupPerPrompt,
    StageSummary,
)
from pipespec_mpi.stage.stats import StageStats

ROOT = Path(__file__).resolve().parents[2]

# (where in the run directory, the type): every object a results line, summary.json or benchmark.json holds
OUTPUT_TABLES: tuple[tuple[str, type], ...] = (
    (f"{RESULTS}: one line", Record),
    (f"{RESULTS}: each entry of `stages` (one per stage)", StageStats),
    (f"{SUMMARY}: each method's entry", MethodSummary),
    (f"{SUMMARY}: each value of an entry's `acceptance` (per stage pair)", PairAcceptance),
    (f"{SUMMARY}: each entry of an entry's `stages`", StageSummary),
    (f"{BENCHMARK}: each method's entry", BenchmarkRow),
    (f"{BENCHMARK}: an entry's `speedup_per_prompt`", SpeedupPerPrompt),
)


def outputs_reference() -> str:
    """docs/outputs-fields.md: the fields of results.jsonl, summary.json and benchmark.json."""
    out = [GENERATED, "", "# Output fields reference", "",
           "Every field of the JSON objects a run directory's files hold, as written in "
           "`pipespec_mpi/records.py` and `pipespec_mpi/stage/stats.py` (the files themselves and how "
           "they are read: `docs/outputs.md`). \"if absent\": what a reader takes for a key that a file "
           "written before the field existed lacks; \"required\": every file has it."]  # fmt: skip
    for where, cls in OUTPUT_TABLES:
        out += ["", f"## {where} ({cls.__name__})", ""]
        if text := heading_text(cls):
            out += [text, ""]
        out += field_table(cls, heads=("field", "type", "if absent", "meaning"))
    return "\n".join(out) + "\n"


def render_all() -> dict[str, str]:
    """Each generated file (its path under the repository) -> its text as the sources say now."""
    return {"docs/config.md": config_reference(), "docs/outputs-fields.md": outputs_reference()}


def stale(root: Path = ROOT, rendered: dict[str, str] | None = None) -> list[str]:
    """The generated files under ``root`` whose text is not ``rendered`` (missing ones included)."""
    rendered = render_all() if rendered is None else rendered
    return [
        rel for rel, text in rendered.items()
        if not (root / rel).is_file() or (root / rel).read_text(encoding="utf-8") != text
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m pipespec_mpi.analysis.reference", description=__doc__.split("\n\n")[0]
    )
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--write", action="store_true", help="(re)write docs/config.md and docs/outputs-fields.md"
    )
    mode.add_argument("--check", action="store_true", help="exit 1 when either differs from the sources")
    ap.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this checkout)")
    args = ap.parse_args(argv)
    if args.write:
        for rel, text in render_all().items():
            (args.root / rel).parent.mkdir(parents=True, exist_ok=True)
            (args.root / rel).write_text(text, encoding="utf-8")
            print(f"wrote {rel}")
        return 0
    bad = stale(args.root)
    for rel in bad:
        print(f"{rel} is stale (or missing): regenerate it with `{COMMAND}`", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
