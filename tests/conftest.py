"""Shared helpers: launch the real app under the venv's mpirun, with a timeout, and read its
records (pipespec_mpi.records)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipespec_mpi.records import RESULTS, Record, read_records

ROOT = Path(__file__).resolve().parents[1]
MPIRUN = Path(sys.executable).parent / "mpirun"
METHODS = ("ar", "sd", "pipespec")  # run.methods' default
LONG = "long tier (CI's 35 minutes hold the rest): bash scripts/test.sh --long runs it"


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


def launch_ok(
    n: int, overrides: list[str], run_dir: Path, timeout: float = 240, env: dict | None = None
) -> list[Record]:
    """``launch``, checked to exit 0: the run's records (results.jsonl)."""
    proc = launch(n, overrides, run_dir, timeout, env)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return read_records(Path(run_dir) / RESULTS)


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


def outputs_by_method(records: list[Record]) -> dict[str, dict[tuple, list[int]]]:
    """method -> (prompt, warm-up) -> output ids."""
    out: dict[str, dict[tuple, list[int]]] = {}
    for r in records:
        out.setdefault(r.method, {})[(r.prompt_id, r.warmup)] = r.output_ids
    return out


def outputs(recs: list[Record]) -> dict[tuple[str, int], dict[tuple, list[int]]]:
    """(method, batch size) -> (prompt, sample) -> output ids, warm-ups left out."""
    out: dict[tuple[str, int], dict[tuple, list[int]]] = {}
    for r in recs:
        if not r.warmup:
            out.setdefault((r.method, r.batch_size), {})[(r.prompt_id, r.sample_idx)] = r.output_ids
    return out


def assert_all_equal_ar(recs: list[Record], groups: set[tuple[str, int]]) -> None:
    """Greedy losslessness: the records are exactly ``groups`` (method, batch size), each with
    AR's outputs at its smallest batch size, prompt for prompt; the warm-ups (batch 1, uncounted)
    equal AR's warm-ups."""
    by = outputs(recs)
    assert set(by) == groups
    ref = by[min(g for g in groups if g[0] == "ar")]
    for g, outs in by.items():
        assert outs == ref, f"{g} differs from AR"
    warm = outputs_by_method([r for r in recs if r.warmup])
    if warm:
        assert set(warm) == {m for m, _ in groups}
        for m, outs in warm.items():
            assert outs == warm["ar"], f"{m}'s warm-up differs from AR's"
