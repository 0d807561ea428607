"""Stopping a job early (run/drain.py) under real mpirun: SIGUSR2 to one rank only, or a STOP file,
stops every replica at its next start gate (the stages vote), the prompts in flight are written
whole, the job exits with EXIT_DRAINED, and a resumed run finishes with exactly the results of
an uninterrupted one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import MPIRUN, ROOT, launch_ok

from pipespec_mpi.records import RESULTS, Record, read_records
from pipespec_mpi.run.drain import EXIT_DRAINED

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

# two stages (the vote is the same over any number of them; fewer ranks start faster)
OVERRIDES = ["hierarchy=tiny2", "dataset=synthetic", "dataset.n_prompts=10", "decode.max_new_tokens=48",
             "run.mode=benchmark", "run.methods=[ar,pipespec]", "run.progress=false"]  # fmt: skip


def key(r: Record) -> tuple:
    return (r.prompt_id, r.method, r.warmup, r.sample_idx, r.batch_size)


def start(n: int, run_dir: Path, extra: list[str]) -> subprocess.Popen:
    cmd = [str(MPIRUN), "-n", str(n), sys.executable, "-m", "pipespec_mpi", *OVERRIDES, *extra,
           f"hydra.run.dir={run_dir}"]  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_records(run_dir: Path, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        parts = list((run_dir / "parts").glob("*.jsonl"))
        if sum(p.read_text().count("\n") for p in parts) >= n:
            return
        time.sleep(0.02)
    proc.kill()
    pytest.fail(f"no {n} records within {timeout} s: {proc.communicate()[0][-3000:]}")


def ranks_of(proc: subprocess.Popen) -> list[psutil.Process]:
    kids = psutil.Process(proc.pid).children(recursive=True)
    return [p for p in kids if "pipespec_mpi" in " ".join(p.cmdline()) and "python" in p.name()]


@pytest.mark.parametrize(
    "how,n,extra",
    [
        ("signal", 4, []),
        pytest.param("file", 2, [], marks=pytest.mark.long),
        pytest.param("file", 2, ["run.batch_sizes=[1,3]"], marks=pytest.mark.long),
    ],
)
def test_a_stopped_job_resumes_to_the_uninterrupted_results(tmp_path, how, n, extra):
    """(With a batch sweep: the stop may come in the batched phase, where each slot votes at its
    own gate; the phases not started are left, and the resumed run decodes them.)"""
    full = launch_ok(n, [*OVERRIDES, *extra], tmp_path / "full")
    run_dir = tmp_path / "stopped"
    proc = start(n, run_dir, extra)
    wait_for_records(run_dir, 25 if extra else 2, proc)  # batched: into the first batched phase
    if how == "signal":
        ranks = ranks_of(proc)
        assert len(ranks) == n
        os.kill(ranks[-1].pid, signal.SIGUSR2)  # one rank of one replica only: the vote stops all
    else:
        (run_dir / "STOP").touch()
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == EXIT_DRAINED, out[-3000:]
    assert "stopped on request" in out and "run.resume=true" in out
    first = read_records(run_dir / RESULTS)
    assert 0 < len(first) < len(full)
    if extra:
        assert any(r.batch_size == 3 for r in first)
    want = {key(r): r.output_ids for r in full}
    assert all(want[key(r)] == r.output_ids for r in first)  # whole prompts, right ones
    resumed = launch_ok(n, [*OVERRIDES, *extra, "run.resume=true"], run_dir)
    assert {key(r): r.output_ids for r in resumed} == want
    assert not (run_dir / "STOP").exists()
