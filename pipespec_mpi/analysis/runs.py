"""Run directories found and loaded for the report: a single run, several, or a Hydra multirun
directory (its subdirectories in job order), each with its records and composed config."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipespec_mpi.config import AppConfig, ConfigError, load_run_config
from pipespec_mpi.records import RESULTS, Record, read_records


class ReportError(ValueError):
    """A path given on the command line holds no run."""


@dataclass
class Run:
    """One run directory: its records (warm-up included) and what Hydra saved about it."""

    path: Path
    records: list[Record]
    config: AppConfig | None = None  # None: the run has none that loads
    overrides: list[str] = field(default_factory=list)
    multirun: Path | None = None  # the multirun dir this run was found in
    label: str = ""

    @property
    def measured(self) -> list[Record]:
        return [r for r in self.records if not r.warmup]


# --------------------------------------------------------------------------------------------
# finding and loading runs


def _yaml(path: Path) -> Any:
    """A YAML file Hydra saved (``.hydra/*.yaml``) as plain containers; None if absent or unreadable."""
    if not path.is_file():
        return None
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_container(OmegaConf.load(path))
    except Exception:  # noqa: BLE001 - a run without a readable config is still a run
        return None


def load_run(path: Path, multirun: Path | None = None) -> Run:
    path = Path(path)
    try:
        config = load_run_config(path)
    except (OSError, ConfigError):  # no config, or one only an older version reads: still a run
        config = None
    overrides = _yaml(path / ".hydra" / "overrides.yaml")
    return Run(
        path=path,
        records=read_records(path / RESULTS),
        config=config,
        overrides=[str(o) for o in overrides] if isinstance(overrides, list) else [],
        multirun=multirun,
    )


def _subdir_key(p: Path) -> tuple:
    return (0, int(p.name), "") if p.name.isdigit() else (1, 0, p.name)


def find_runs(paths: Sequence[str | Path]) -> list[Run]:
    """Run dirs named by ``paths``: a run dir itself, or a multirun dir's numbered subfolders."""
    runs: list[Run] = []
    for p in map(Path, paths):
        if (p / RESULTS).is_file():
            runs.append(load_run(p))
            continue
        if not p.is_dir():
            raise ReportError(f"{p}: no such directory")
        subs = sorted((d for d in p.iterdir() if d.is_dir()), key=_subdir_key)
        found = [d for d in subs if (d / RESULTS).is_file()]
        if not found:
            raise ReportError(f"{p}: no {RESULTS} here or in its subfolders (is it a run dir?)")
        for d in subs:
            if d not in found and d.name.isdigit():
                print(f"[report] {d}: no {RESULTS} (job failed or still running?)", file=sys.stderr)
        runs.extend(load_run(d, multirun=p) for d in found)
    _label(runs)
    return runs


def _label(runs: list[Run]) -> None:
    """Short, unique labels: the shortest path tail that tells the runs apart (at least
    ``<multirun>/<n>`` for a multirun job, whose bare number says little)."""
    paths = [r.path.resolve() for r in runs]
    for n in range(1, max(len(p.parts) for p in paths) + 1):
        tails = [
            "/".join(p.parts[-max(n, 2 if r.multirun else 1) :]).lstrip("/")
            for r, p in zip(runs, paths, strict=True)
        ]
        if len(set(tails)) == len(tails):
            break
    for r, t in zip(runs, tails, strict=True):
        r.label = t


def cross_run_dir(runs: Sequence[Run], out: str | Path | None = None) -> Path | None:
    """Where cross-run plots go: ``out``; else the multirun dir given (if exactly one); else
    the runs' common parent folder; ``None`` for a single run or runs with no common folder."""
    if out is not None:
        return Path(out)
    if len(runs) < 2:
        return None
    multiruns = {r.multirun.resolve() for r in runs if r.multirun is not None}
    if len(multiruns) == 1:
        return multiruns.pop()
    common = Path(os.path.commonpath([r.path.resolve() for r in runs]))
    return None if common == Path(common.anchor) else common
