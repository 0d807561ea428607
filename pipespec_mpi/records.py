"""Reading ``results.jsonl``: one JSON record per (prompt, method, sample) and line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = "results.jsonl"


def read_records(path: Path) -> list[dict]:
    """The records of a results file; a line cut short (a killed job) is reported and skipped."""
    out = []
    for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                print(f"[pipespec_mpi] {path}:{i}: skipping a malformed line", file=sys.stderr)
    return out
