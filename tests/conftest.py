"""Shared helpers: launch the real app under the venv's mpirun, with a timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MPIRUN = Path(sys.executable).parent / "mpirun"
LONG = "long tier (CI's 30 minutes hold the rest): bash scripts/test.sh --long runs it"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", help="also run the tests marked long (" + LONG + ")")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``long`` (more cases of what CI already runs, and the Slurm time-limit
    test) are skipped with the reason unless ``--long``."""
    if config.getoption("--long"):
        return
    for item in items:
        if "long" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=LONG))


def launch(
    n: int, overrides: list[str], run_dir: Path, timeout: float = 240, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run ``mpirun -n N python -m pipespec_mpi OVERRIDES hydra.run.dir=RUN_DIR``."""
    cmd = [str(MPIRUN), "-n", str(n), sys.executable, "-m", "pipespec_mpi", *overrides,
           "run.progress=false", f"hydra.run.dir={run_dir}"]  # fmt: skip
    full_env = {**os.environ, **(env or {})}
    try:
        return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"mpirun timed out after {timeout} s: {' '.join(cmd)}\n{err.stdout}\n{err.stderr}")


def launch_ok(n: int, overrides: list[str], run_dir: Path, timeout: float = 240, env=None) -> list[dict]:
    proc = launch(n, overrides, run_dir, timeout, env)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return read_results(run_dir)


def run_ranks(script: str, n: int, args: list[str], timeout: float = 120) -> str:
    """Run ``mpirun -n N python SCRIPT ARGS`` (a test file that is also one rank of a run); its
    stdout, after checking that it exited 0."""
    cmd = [str(MPIRUN), "-n", str(n), sys.executable, script, *args]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"timed out: {' '.join(cmd)}\n{err.stdout}\n{err.stderr}")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def read_results(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "results.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def outputs_by_method(records: list[dict]) -> dict[str, dict[tuple, list[int]]]:
    out: dict[str, dict[tuple, list[int]]] = {}
    for r in records:
        out.setdefault(r["method"], {})[(r["prompt_id"], r["warmup"])] = r["output_ids"]
    return out


def outputs(recs: list[dict]) -> dict[tuple[str, int], dict[tuple, list[int]]]:
    """(method, batch size) -> (prompt, sample) -> output ids, warm-ups left out."""
    out: dict[tuple[str, int], dict[tuple, list[int]]] = {}
    for r in recs:
        if not r["warmup"]:
            out.setdefault((r["method"], r["batch_size"]), {})[(r["prompt_id"], r["sample_idx"])] = r[
                "output_ids"
            ]
    return out


def assert_all_equal_ar(recs: list[dict], groups: set[tuple[str, int]]) -> None:
    by = outputs(recs)
    assert set(by) == groups
    ref = by[min(g for g in groups if g[0] == "ar")]
    for g, outs in by.items():
        assert outs == ref, f"{g} differs from AR"
