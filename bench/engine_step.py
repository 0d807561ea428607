"""The target's forwards on the engine against another commit's, interleaved in one run.

    .venv/bin/python bench/engine_step.py --other /path/to/checkout [--rounds 7] [--threads 2]

Times what a stage's forwards cost on the embedded SmolLM2 (the default job's target, as
``load_stage`` builds it, exact rows): a one-token step, verifications of 4 and 8 proposals, and
a batched step of 4 slots, each at 200 positions of context; this tree and ``--other`` (a checkout
of any commit with ``load_stage``) alternate in fresh processes, round by round, so that the
machine's drift hits both alike. Prints the medians and their ratio (this / other).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CASES = ("step", "verify4", "verify8", "batch4")


def measure(repeats: int, context: int) -> dict[str, float]:
    """Median seconds of each case on this interpreter's package (run in a child)."""
    import torch

    from pipespec_mpi.config import compose_config
    from pipespec_mpi.models.loader import load_stage

    try:
        from pipespec_mpi.stage.batch import score_batch
    except ImportError:  # commits before the engine's score_many
        from pipespec_mpi.models.base import score_batch

    hier = compose_config(["hierarchy=smollm2_suffix"]).hierarchy
    sc = load_stage(hier, hier.n_stages - 1, [])
    prompt = [(17 * i + 5) % 40000 for i in range(context)]
    slots = [sc] + [sc.for_slot() for _ in range(3)]
    for s in slots:
        s.prefill(prompt, room=32)

    def one(k: int) -> None:
        sc.logits(prompt, [11] * k)
        sc.truncate(context - 1)

    def batch() -> None:
        score_batch([(s, prompt, []) for s in slots])
        for s in slots:
            s.truncate(context - 1)

    fns = {"step": lambda: one(0), "verify4": lambda: one(4), "verify8": lambda: one(8), "batch4": batch}
    out = {}
    with torch.inference_mode():
        for name, fn in fns.items():
            fn()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            out[name] = statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--other", required=True, help="a checkout of the commit to compare with")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        import torch

        torch.set_num_threads(a.threads)
        print(json.dumps(measure(a.repeats, a.context)))
        return
    here = Path(__file__).resolve().parents[1]
    trees = {"this": here, "other": Path(a.other).resolve()}
    got: dict[str, dict[str, list[float]]] = {t: {c: [] for c in CASES} for t in trees}
    for r in range(a.rounds):
        for name, tree in trees.items() if r % 2 == 0 else reversed(trees.items()):
            cmd = [sys.executable, str(here / "bench" / "engine_step.py"), "--other", ".", "--child",
                   "--repeats", str(a.repeats), "--context", str(a.context),
                   "--threads", str(a.threads)]  # fmt: skip
            env = {**os.environ, "PYTHONPATH": str(tree)}
            res = json.loads(subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True,
                                            check=True).stdout.splitlines()[-1])  # fmt: skip
            for c in CASES:
                got[name][c].append(res[c])
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
    print(f"{'case':10} {'this ms':>9} {'other ms':>9} {'this/other':>11}")
    for c in CASES:
        t, o = statistics.median(got["this"][c]), statistics.median(got["other"][c])
        print(f"{c:10} {t * 1e3:9.2f} {o * 1e3:9.2f} {t / o:11.3f}")


if __name__ == "__main__":
    main()
