"""The explorer's tick comparison: each schedule's verdict, tick count and a digest of every stage
outcome (tokens, finish reason, every counter on the explorer's clock; host readings aside), one
JSON line per schedule. Run on two commits (PYTHONPATH=<checkout>) and diff the outputs: equal
lines show a change altered no decision (docs/protocol.md, "Long run").

    python bench/explore_digest.py --families pipespec-greedy,sd-greedy --seeds 150 > a.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json

from pipespec_mpi.simulate.explore import FAMILIES, Scenario, World

HOST = ("perf_counter", "rss", "cpu_")  # readings of the host, not decisions of the loop


def digest(world: World) -> str:
    """A hash of every stage outcome the world kept."""
    parts = []
    for key in sorted(world.outcomes):
        o = world.outcomes[key]
        stats = {k: v for k, v in dataclasses.asdict(o.stats).items() if not any(h in k for h in HOST)}
        parts.append([list(key), o.tokens, o.finish_reason, stats])
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (default: all)")
    ap.add_argument("--seeds", type=int, default=150, help="seeds 0..N-1 of each family")
    ap.add_argument("--preset", default=None, help="a scenario preset (e.g. slurm-sweep)")
    a = ap.parse_args()
    for family in a.families.split(","):
        for seed in range(a.seeds):
            world = World(Scenario.draw(family, seed, a.preset) if a.preset else Scenario.draw(family, seed))
            found = world.run()
            print(json.dumps([family, seed, found.verdict, found.ticks, digest(world)]), flush=True)


if __name__ == "__main__":
    main()
