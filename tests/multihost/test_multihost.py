"""Pipelines and replicas across hosts, on the multi-host bed (tests/multihost/netbed.py).

Three hosts are network namespaces with their own hostnames, joined by a wire that delays every
packet by 0.2 ms each way; MPICH's hydra starts the ranks in them, so MPI sees three nodes (no
shared memory between them: UCX is held to TCP). Skipped, with the reason, where the bed cannot
be made (not root, no TUN device). The models are the tiny float64 ones, where equality with AR
is exact, so a lost, reordered or stale message shows as a different token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import netbed
import pytest
from conftest import ROOT, outputs_by_method

from pipespec_mpi.records import RESULTS, Record, read_records

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.multihost]

DELAY_MS = 0.2
PY = sys.executable


@pytest.fixture(scope="module")
def bed():
    why = netbed.problem()
    if why:
        pytest.skip(f"no multi-host bed here: {why}")
    b = netbed.NetBed(netbed.BedConfig(name="pstest", hosts=3, delay_ms=DELAY_MS, net=79))
    b.up()
    yield b
    b.down()


def run_on(bed, n: int, ppn: int, command: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    argv = bed.mpirun(n, ppn, command, hosts=-(-n // ppn))
    try:
        return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=os.environ)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"timed out after {timeout} s: {' '.join(argv)}\n{err.stdout}\n{err.stderr}")


def app(bed, n: int, ppn: int, overrides: list[str], run_dir: Path) -> list[Record]:
    proc = run_on(
        bed, n, ppn, [PY, "-m", "pipespec_mpi", *overrides, "run.progress=false", f"hydra.run.dir={run_dir}"]
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return read_records(run_dir / RESULTS)


def assert_lossless(recs: list[Record], methods: list[str]) -> None:
    by = outputs_by_method(recs)
    assert sorted(by) == sorted(methods)
    for m in methods:
        assert by[m] == by["ar"], f"{m} differs from ar"


def test_the_wire_delays_every_packet(bed, tmp_path):
    """MPI round trips between two hosts take at least the two one-way delays (the network is
    used, not shared memory), and within one host they do not."""
    script = tmp_path / "pingpong.py"
    script.write_text(
        "import time\nimport numpy as np\nfrom mpi4py import MPI\n"
        "c = MPI.COMM_WORLD\nb = np.zeros(8, dtype=np.int64)\npeer = 1 - c.rank\n"
        "for i in range(220):\n"
        "    if i == 20: c.Barrier(); t = time.perf_counter()\n"
        "    if c.rank == 0: c.Send(b, peer); c.Recv(b, peer)\n"
        "    else: c.Recv(b, peer); c.Send(b, peer)\n"
        "dt = (time.perf_counter() - t) / 200 * 1e3\n"
        "names = c.gather(MPI.Get_processor_name())\n"
        "if c.rank == 0: print('RTT_MS', dt, *names, flush=True)\n"
    )
    rtt = {}
    for ppn in (1, 2):
        proc = run_on(bed, 2, ppn, [PY, str(script)], timeout=60)
        assert proc.returncode == 0, proc.stderr
        line = next(ln.split() for ln in proc.stdout.splitlines() if ln.startswith("RTT_MS"))
        rtt[ppn] = float(line[1])
        assert len(set(line[2:])) == (2 if ppn == 1 else 1), line
    assert rtt[1] >= 2 * DELAY_MS, rtt
    assert rtt[2] < DELAY_MS, rtt


@pytest.mark.parametrize(
    "transport,window,expect_window",
    [
        ("mpi", "auto", "push"),
        pytest.param("gloo", "auto", "push", marks=pytest.mark.long),
        pytest.param("mpi", "rma", "rma", marks=pytest.mark.long),
    ],  # fmt: skip
)
def test_a_pipeline_across_hosts_is_lossless(bed, tmp_path, transport, window, expect_window):
    """Stages 0-1 on one host, stage 2 on another: the epochs cross the network (pushed headers
    by default, the RMA window when asked), proposals too (MPI, or gloo with the rendezvous
    interface picked by pipespec_mpi: the hosts' names resolve to nothing here)."""
    methods = ["ar", "sd", "pipespec"]
    recs = app(
        bed, 3, 2,
        ["hierarchy=tiny", "run.mode=benchmark", "decode.lookahead=2", f"transport.kind={transport}",
         f"run.epochs_window={window}", "decode.max_new_tokens=40", "dataset.n_prompts=3",
         "decode.policy=static"],  # rollbacks must cross the hosts: the fixed rule always verifies
        tmp_path,
    )  # fmt: skip
    assert_lossless(recs, methods)
    for r in recs:
        assert r.epochs_window == expect_window
        assert r.transport == transport
        assert r.hosts == ["pstest-h0", "pstest-h0", "pstest-h1"]
    ps = [r for r in recs if r.method == "pipespec"]
    assert sum(r.stages[-1].rollbacks_signalled for r in ps) > 0  # rollbacks crossed hosts
    assert sum(r.stages[-1].tokens_accepted for r in ps) > 0


@pytest.mark.long
def test_every_stage_on_its_own_host_with_leviathan_sampling(bed, tmp_path):
    """Three hosts, one stage each: proposals carry their distributions across both links."""
    recs = app(
        bed, 3, 1,
        ["hierarchy=tiny", "run.methods=[pipespec]", "sampling.temperature=1.0", "decode.max_new_tokens=24",
         "dataset.n_prompts=2"],
        tmp_path,
    )  # fmt: skip
    assert {tuple(r.hosts) for r in recs} == {("pstest-h0", "pstest-h1", "pstest-h2")}
    assert all(r.epochs_window == "push" for r in recs)
    # Sampled outputs depend on when each stage draws, so a sequence may sample EOS (id 257 of
    # the tiny vocabulary, about 1 run in 2 here): it ends early, and only then.
    for r in recs:
        assert (r.finish_reason, r.n_new_tokens == 24) in {("length", True), ("eos", False)}, r


@pytest.mark.long
def test_replicas_on_different_hosts_share_the_prompts(bed, tmp_path):
    """Two replicas, one per host: each pipeline is node-local (shared-memory window), the
    prompts are split between the hosts, and rank 0 merges every replica's results."""
    recs = app(
        bed, 6, 3,
        ["hierarchy=tiny", "run.mode=benchmark", "run.methods=[ar,pipespec]", "decode.max_new_tokens=24",
         "dataset.n_prompts=4"],
        tmp_path,
    )  # fmt: skip
    assert_lossless(recs, ["ar", "pipespec"])
    hosts = {r.replica: tuple(r.hosts) for r in recs}
    assert hosts == {0: ("pstest-h0",) * 3, 1: ("pstest-h1",) * 3}
    assert all(r.epochs_window == "shared" for r in recs)
    counted = {(r.prompt_id, r.replica) for r in recs if not r.warmup}
    assert {rep for _, rep in counted} == {0, 1}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["pipespec"]["n_prompts"] + summary["ar"]["n_prompts"] == len(
        [r for r in recs if not r.warmup]
    )


def test_a_rendezvous_port_that_nothing_answers_ends_the_job_within_the_limit_naming_the_phase(tmp_path):
    """A firewall between the hosts drops the rendezvous port (the wire drops TCP to it): rank
    1 cannot reach rank 0's store, and the job ends after transport.rendezvous_timeout_s with the
    step, the rank and the job's hosts named, instead of hanging (it sat 240 s with empty logs)."""
    why = netbed.problem()
    if why:
        pytest.skip(f"no multi-host bed here: {why}")
    port = 29517
    with netbed.NetBed(netbed.BedConfig(name="psfw", hosts=2, net=81, drop_tcp_ports=(port,))) as fw:
        t0 = time.monotonic()
        over = ["hierarchy=tiny2", "dataset=synthetic", "dataset.n_prompts=1", "transport.kind=gloo",
                f"transport.port={port}", "transport.rendezvous_timeout_s=10", "run.progress=false",
                f"hydra.run.dir={tmp_path}"]  # fmt: skip
        proc = run_on(fw, 2, 1, [PY, "-m", "pipespec_mpi", *over], timeout=120)
        took = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, f"exit {proc.returncode}\n{out[-3000:]}"
    phase = "start-up phase 'rendezvous (gloo): store' failed: rank 1 (psfw-h1) could not connect to"
    assert phase in out, out[-3000:]
    assert "within 10 s (transport.rendezvous_timeout_s)" in out
    assert "psfw-h0" in out and "psfw-h1" in out and took < 90, took
    assert not (tmp_path / "results.jsonl").exists()


def test_a_bed_comes_down_clean():
    """up / down leave no namespace or wire behind (a killed test's bed is replaced by the next)."""
    why = netbed.problem()
    if why:
        pytest.skip(f"no multi-host bed here: {why}")
    cfg = netbed.BedConfig(name="psdown", hosts=2, net=80)
    with netbed.NetBed(cfg):
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert "psdown-h0" in listed and "psdown-h1" in listed
        pid = int((cfg.state / "wire.pid").read_text())
    time.sleep(0.1)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "psdown-h" not in listed
    assert not cfg.state.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
