"""CPU dispatch levels (tests/dispatch_levels.py) under real mpirun: a level the CPU cannot honour,
or NCCL on a node without CUDA, stops the job with one clear error. (That greedy AR, SD and
PipeSpec commit the same tokens under every level this machine can run: the ``dispatch-*`` cases
of tests/mpi/cases.py.)"""

from __future__ import annotations

import pytest
import torch
from conftest import launch

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def test_a_dispatch_the_cpu_cannot_honour_stops_the_job(tmp_path):
    proc = launch(3, ["hierarchy=tiny"], tmp_path, timeout=120, env={"PIPESPEC_KERNEL_ISA": "sse2"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "PIPESPEC_KERNEL_ISA=sse2 is not one of avx512, avx2" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "results.jsonl").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a node with CUDA")
def test_nccl_on_a_node_without_cuda_stops_the_job(tmp_path):
    proc = launch(3, ["hierarchy=tiny", "transport.kind=nccl"], tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "transport.kind=nccl needs CUDA" in proc.stderr and "Traceback" not in proc.stderr
