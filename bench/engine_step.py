"""The target's forwards on the engine against another commit's, paired call by call in one process.

    .venv/bin/python bench/engine_step.py --other /path/to/checkout [--pairs 60] [--threads 2]

Times what a stage's forwards cost on the embedded SmolLM2 (the default job's target, as
``load_stage`` builds it, exact rows): a one-token step and verifications of 4 and 8 proposals at
200 positions of context. The other checkout's package is copied under another name
(``pipespec_other``) so that both load in this process; their calls alternate, in alternating
order, so the machine's drift (up to 2x within minutes on these CPUs) hits every pair alike.
Prints each side's median and the median of the paired ratios (this / other), and whether their
logits are bitwise equal.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

CONTEXT = 200


def other_package(checkout: Path, into: Path) -> None:
    """``checkout``'s pipespec_mpi as ``into``/pipespec_other (imports renamed, its conf/ beside)."""
    dst = into / "pipespec_other"
    shutil.copytree(checkout / "pipespec_mpi", dst, ignore=shutil.ignore_patterns("__pycache__"))
    for path in dst.rglob("*.py"):
        path.write_text(path.read_text().replace("pipespec_mpi", "pipespec_other"))
    (into / "conf").symlink_to(checkout / "conf")


def target(package: str):
    """The default pair's target stage, loaded by ``package``'s own loader."""
    config = __import__(f"{package}.config", fromlist=["compose_config"])
    loader = __import__(f"{package}.models.loader", fromlist=["load_stage"])
    hier = config.compose_config(["hierarchy=smollm2_suffix"]).hierarchy
    return loader.load_stage(hier, hier.n_stages - 1, [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--other", required=True, help="a checkout of the commit to compare with")
    ap.add_argument("--pairs", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    here = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(here))
    with tempfile.TemporaryDirectory() as tmp:
        other_package(Path(a.other).resolve(), Path(tmp))
        sys.path.insert(0, tmp)
        scorers = {"this": target("pipespec_mpi")}
        cwd = os.getcwd()
        os.chdir(a.other)  # the other loader finds its conf/ and data from its checkout
        scorers["other"] = target("pipespec_other")
        os.chdir(cwd)
        prompt = [(17 * i + 5) % 40000 for i in range(CONTEXT)]
        times: dict[tuple[int, str], list[float]] = {}
        with torch.inference_mode():
            for sc in scorers.values():
                sc.prefill(prompt, room=32)
            same = []
            for sc in scorers.values():
                same.append(sc.logits(prompt, [11] * 8))
                sc.truncate(CONTEXT - 1)
            print(f"logits bitwise equal: {torch.equal(*same)}")
            print(f"{'case':10} {'this ms':>9} {'other ms':>9} {'paired this/other':>18}")
            for k in (0, 4, 8):
                order = list(scorers.items())
                for i in range(3 + a.pairs):
                    for name, sc in order if i % 2 == 0 else order[::-1]:
                        t0 = time.perf_counter()
                        sc.logits(prompt, [11] * k)
                        sc.truncate(CONTEXT - 1)
                        if i >= 3:
                            times.setdefault((k, name), []).append(time.perf_counter() - t0)
                this, other = times[(k, "this")], times[(k, "other")]
                ratio = statistics.median(t / o for t, o in zip(this, other, strict=True))
                case = "step" if k == 0 else f"verify{k}"
                print(f"{case:10} {statistics.median(this) * 1e3:9.2f} {statistics.median(other) * 1e3:9.2f} "
                      f"{ratio:18.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
