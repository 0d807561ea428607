"""The start-up across hosts in its fastest form (no model: tests/multihost/startup_probe.py), and
its bound: a rank that never reaches the rendezvous makes the others end the job within
transport.rendezvous_timeout_s, naming it. Quick (about 40 s in all), so CI runs it with every
change; bench/startup_stress.py launches the same probe many times.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import netbed
import pytest
from conftest import ROOT

pytestmark = [pytest.mark.mpi, pytest.mark.multihost]

PY = sys.executable
PROBE = Path(__file__).with_name("startup_probe.py")


@pytest.fixture(scope="module")
def bed():
    why = netbed.problem()
    if why:
        pytest.skip(f"no multi-host bed here: {why}")
    with netbed.NetBed(netbed.BedConfig(name="psup", hosts=2, delay_ms=0.2, net=82)) as b:
        yield b


def run_on(bed, command: list[str], env: dict[str, str] | None = None, timeout: float = 180):
    """3 ranks, 2 on host 0 and 1 on host 1: the pipeline that crosses hosts."""
    argv = bed.mpirun(3, 2, command)
    try:
        return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})  # fmt: skip
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"hung: still running after {timeout} s: {' '.join(argv)}\n{err.stdout}\n{err.stderr}")


@pytest.mark.parametrize("transport", ["gloo", "strict"])
def test_the_start_up_across_hosts_ends(bed, tmp_path, transport):
    """Every rank is through the rendezvous' steps, the channels and the windows."""
    proc = run_on(bed, [PY, str(PROBE), str(tmp_path), f"transport.kind={transport}"])
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "probe: start-up done" in proc.stdout
    for r in range(3):
        log = (tmp_path / f"rank{r}.log").read_text()
        assert "rendezvous (gloo): gloo pairs done" in log.replace(f"({transport})", "(gloo)"), log
        assert "channels and windows done" in log, log


def test_a_rank_that_never_reaches_the_rendezvous_ends_the_job_in_the_bound_naming_it(bed, tmp_path):
    """Rank 2 (host 1) stops answering as its rendezvous begins: ranks 0 and 1 end the job once
    transport.rendezvous_timeout_s has passed, in one message naming rank 2 and its host (before,
    they waited in the rendezvous until the 900 s start-up watchdog)."""
    over = ["hierarchy=tiny", "dataset=synthetic", "dataset.n_prompts=1", "transport.kind=gloo",
            "transport.rendezvous_timeout_s=5", "run.progress=false",
            f"hydra.run.dir={tmp_path}"]  # fmt: skip
    t0 = time.monotonic()
    proc = run_on(bed, [PY, "-m", "pipespec_mpi", *over], {"PIPESPEC_INJECT_FAULT": "hang@2:rendezvous"})
    took = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, f"exit {proc.returncode}\n{out[-3000:]}"
    named = "rank 2 (psup-h1) did not reach the rendezvous within 5 s (transport.rendezvous_timeout_s)"
    assert named in out, out[-3000:]
    assert "start-up phase 'rendezvous (gloo): check-in' failed" in out
    assert "Traceback" not in out  # one message, not a rank's stack
    assert took < 90, took  # the ranks' start (imports, config) under load, then the 5 s bound
    assert not (tmp_path / "results.jsonl").exists()
