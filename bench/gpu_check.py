"""The checks of bench/gpu_check.sh, one subcommand each (exit 1: the check failed; 2: unusable):

python bench/gpu_check.py env [--cuda]                 what this python brings (and lacks)
python bench/gpu_check.py compiled PROFILE             the profile's compiled forwards did
                                                       what the engine says (compile_problems)
python bench/gpu_check.py job RUN_DIR [--epsilon E] [--compiled]
    a job's outputs: every method at every batch size against AR at the smallest, exactly
    (no --epsilon) or by the near-tie rule (analysis/ties.py) with the gaps of the job's own
    target, rebuilt from the run's config (random weights: from their seed); ties.json
python bench/gpu_check.py table OUT_DIR RUN_DIR...      OUT_DIR/results.md
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: the checkout's package
    sys.path.insert(0, str(ROOT))


def env(cuda: bool) -> int:
    """Versions of what the run imports; exit 2 naming what is missing (the bundle's part)."""
    missing, have = [], {}
    for name in ("torch", "transformers", "hydra", "omegaconf", "yaml", "mpi4py"):
        try:
            have[name] = getattr(__import__(name), "__version__", "?")
        except ImportError as err:
            missing.append(f"{name} ({err})")
    if missing:
        print(
            f"gpu_check: this python lacks {'; '.join(missing)}: hydra, omegaconf and mpi4py come "
            "from bench/gpu_bundle.sh's folder (GPU_BUNDLE), torch and transformers from the site"
        )
        return 2
    import torch

    try:
        from mpi4py import MPI

        mpi = MPI.Get_library_version().splitlines()[0].strip()
    except (ImportError, RuntimeError) as err:  # mpi4py without an MPI library it can load
        print(f"gpu_check: mpi4py {have['mpi4py']} finds no MPI library ({err}): bench/gpu_bundle.sh "
              "brings MPICH and an mpi4py that loads it")  # fmt: skip
        return 2
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    print(
        f"  python {sys.version.split()[0]}, " + ", ".join(f"{k} {v}" for k, v in have.items()) + f"; {mpi}"
    )
    print(
        f"  CUDA {torch.version.cuda}: {len(gpus)} GPU(s) {', '.join(gpus)}" if gpus else "  no CUDA device"
    )
    if cuda and not gpus:
        print("gpu_check: no CUDA device (the CPU mode is bench/gpu_check.sh --cpu OUT_DIR)")
        return 2
    return 0


def compiled(profile: Path) -> int:
    """Each model's compiled forward: whole, few graphs, captured on CUDA."""
    from pipespec_mpi.simulate.profile import compile_problems

    doc = json.loads(profile.read_text())
    bad = 0
    for name, m in doc["models"].items():
        problems = compile_problems(m)
        graphs = f"{m.get('compiled_graphs')} graphs, {m.get('graph_breaks')} breaks"
        if m.get("cuda_graphs"):
            graphs += f", {m.get('cudagraph_skips')} CUDA-graph skips"
        print(f"  {name}: {graphs}, first calls {m.get('compile_s', float('nan')):.0f} s: "
              + ("as the engine says" if not problems else "NOT " + "; ".join(problems)))  # fmt: skip
        bad += bool(problems)
    return 1 if bad else 0


def target_gaps(run_dir: Path) -> Callable[[Sequence[int]], float]:
    """The top-2 gap of the run's target (its last stage, rebuilt as the job built it, on this
    machine's first GPU or its CPU) after a context of tokens, one eager forward each."""
    import torch

    from pipespec_mpi.analysis.ties import top2_gap
    from pipespec_mpi.config.load import load_run_config
    from pipespec_mpi.models.loader import load_stage

    cfg = load_run_config(run_dir)
    hier = cfg.hierarchy
    scorer = load_stage(hier, hier.n_stages - 1, [0] if torch.cuda.is_available() else [], cfg.device.kernels)

    def gap_after(context: Sequence[int]) -> float:
        scorer.prefill(context, room=1)
        return top2_gap(scorer.logits(context, [])[-1].double().tolist())

    return gap_after


def job(run_dir: Path, epsilon: float | None, expect_compiled: bool) -> int:
    """The job's engines (compiled where asked) and its outputs by the near-tie rule."""
    from pipespec_mpi.analysis.ties import check, pairs_from_records
    from pipespec_mpi.records import read_records

    records = read_records(run_dir / "results.jsonl")
    ok = True
    engines = {e for r in records for e in r.engines if e.startswith("engine")}
    for e in sorted(engines):
        print(f"  {e}")
    if expect_compiled and (eager := [e for e in engines if not e.endswith("compiled")]):
        print(f"  NOT compiled (device.compile=true ran eager): {eager}")
        ok = False
    report = check(
        pairs_from_records(records), epsilon, target_gaps(run_dir) if epsilon is not None else None
    )
    (run_dir / "ties.json").write_text(json.dumps(report.to_json(), indent=2))
    print(f"  outputs: {report.summary()}")
    return 0 if ok and report.ok and report.compared else 1


def table(out: Path, run_dirs: Sequence[Path]) -> int:
    """OUT_DIR/results.md: each job's methods and batch sizes, its tie verdict, the profile."""
    from pipespec_mpi.analysis.table import Column, cell, markdown
    from pipespec_mpi.records import parse_group_key, read_benchmark

    cols = [Column("hierarchy"), Column("method"), Column("batch", True), Column("ms/token", True),
            Column("tokens/s", True), Column("speed-up", True), Column("outputs")]  # fmt: skip
    rows = []
    for d in run_dirs:
        if not (d / "benchmark.json").is_file():
            rows.append([d.name, "-", "-", "-", "-", "-", "did not finish"])
            continue
        ties = json.loads((d / "ties.json").read_text()) if (d / "ties.json").is_file() else None
        verdict = "-" if ties is None else ("ok" if ties["ok"] else "REJECTED")
        if ties and ties["divergences"]:
            verdict += f" ({len(ties['divergences'])} at near-ties)" if ties["ok"] else ""
        for key, row in read_benchmark(d / "benchmark.json").items():
            method, batch = parse_group_key(key)
            rows.append([d.name, method, str(batch), cell(row.ms_per_token, ".2f"),
                         cell(row.tokens_per_s, ".1f"), cell(row.speedup, ".2f"), verdict])  # fmt: skip
    text = ["# bench/gpu_check.sh", "", markdown(cols, rows)]
    profile = out / "profile.json"
    if profile.is_file():
        doc = json.loads(profile.read_text())
        text += ["", f"Profile: {doc['device']}, {doc['dtype']}, torch {doc['torch']}, {doc['date']}", ""]
        pcols = [Column("shape"), Column("step ms", True), Column("compiled ms", True),
                 Column("16 rows ms", True), Column("graphs", True)]  # fmt: skip
        prows = [[name, cell(1e3 * m["verify_s"]["1"], ".2f"),
                  cell(1e3 * m["compiled_verify_s"]["1"], ".2f") if "compiled_verify_s" in m else "-",
                  cell(1e3 * m["verify_s"]["16"], ".2f"), cell(m.get("compiled_graphs"))]
                 for name, m in doc["models"].items()]  # fmt: skip
        text.append(markdown(pcols, prows))
    (out / "results.md").write_text("\n".join(text) + "\n")
    print("\n".join(text[2:3]))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/gpu_check.py", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("env")
    e.add_argument("--cuda", action="store_true", help="a CUDA device is required")
    c = sub.add_parser("compiled")
    c.add_argument("profile", type=Path)
    j = sub.add_parser("job")
    j.add_argument("run_dir", type=Path)
    j.add_argument("--epsilon", type=float, default=None, help="the near-tie rule's gap (default: exact)")
    j.add_argument("--compiled", action="store_true", help="every model stage ran the compiled forward")
    t = sub.add_parser("table")
    t.add_argument("out", type=Path)
    t.add_argument("run_dirs", type=Path, nargs="*")
    a = ap.parse_args(argv)
    if a.cmd == "env":
        return env(a.cuda)
    if a.cmd == "compiled":
        return compiled(a.profile)
    if a.cmd == "job":
        return job(a.run_dir, a.epsilon, a.compiled)
    return table(a.out, a.run_dirs)


if __name__ == "__main__":
    raise SystemExit(main())
