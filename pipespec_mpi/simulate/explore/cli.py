"""Many schedules: ``sweep`` over families and seeds (worker processes), and the command line."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from pipespec_mpi.analysis import table as layout
from pipespec_mpi.analysis.table import Column
from pipespec_mpi.simulate.explore.scenarios import (
    FAMILIES,
    PRESETS,
    Finding,
    Scenario,
)
from pipespec_mpi.simulate.explore.world import World, explore


@dataclass
class Tally:
    family: str
    schedules: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    failures: list[dict] = field(default_factory=list)  # the first few, with seeds

    def add(self, f: Finding) -> None:
        self.schedules += 1
        self.counts[f.verdict] = self.counts.get(f.verdict, 0) + 1
        if not f.ok and len(self.failures) < 10:
            self.failures.append(asdict(f))


def _run_chunk(args: tuple[str, int, int, str | None]) -> list[Finding]:
    family, start, count, preset = args
    return [explore(family, s, preset) for s in range(start, start + count)]


def sweep(
    families: Sequence[str], count: int, start: int = 0, jobs: int = 1, preset: str | None = None
) -> list[Tally]:
    tallies = {f: Tally(f) for f in families}
    chunks = [
        (f, s, min(200, start + count - s), preset)
        for f in families
        for s in range(start, start + count, 200)
    ]
    if jobs > 1:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(jobs) as pool:
            results = pool.imap_unordered(_run_chunk, chunks)
            for found in results:
                for f in found:
                    tallies[f.family].add(f)
    else:
        for ch in chunks:
            for f in _run_chunk(ch):
                tallies[f.family].add(f)
    return list(tallies.values())


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pipespec-explore", description=__doc__.split("\n")[0])
    ap.add_argument("--families", default="all", help=f"comma-separated, or all: {', '.join(FAMILIES)}")
    ap.add_argument("--count", type=int, default=200, help="schedules per family")
    ap.add_argument("--start", type=int, default=0, help="first seed")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes")
    ap.add_argument("--preset", choices=sorted(PRESETS), help="a fixed configuration under every schedule")
    ap.add_argument(
        "--replay", metavar="FAMILY:SEED", help="run one schedule and print its scenario and trace"
    )
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.replay:
        family, _, seed = a.replay.partition(":")
        world = World(Scenario.draw(family, int(seed), a.preset))
        found = world.run()
        print(world.sc)
        print("\n".join(world.trace))
        print(found)
        return 0 if found.ok else 1
    families = FAMILIES if a.families == "all" else tuple(a.families.split(","))
    t0 = time.perf_counter()
    tallies = sweep(families, a.count, a.start, a.jobs, a.preset)
    dt = time.perf_counter() - t0
    if a.json:
        print(json.dumps({"seconds": dt, "families": [asdict(t) for t in tallies]}, indent=2))
    else:
        rows = [
            [
                t.family,
                str(t.schedules),
                ", ".join(f"{k} {v}" for k, v in t.counts.items() if k != "ok") or "none",
            ]
            for t in tallies
        ]
        failures = [
            f"{f['family']}:{f['seed']} {f['verdict']}: {f['detail'][:300]}"
            for t in tallies
            for f in t.failures
        ]
        preset = f", preset {a.preset}" if a.preset else ""
        notes = [*failures, f"seeds {a.start}..{a.start + a.count - 1}{preset}, {dt:.0f} s"]
        print(layout.text((Column("family"), Column("schedules", True), Column("failures")), rows, notes))
    return 0 if all(t.counts.get("ok", 0) == t.schedules for t in tallies) else 1
