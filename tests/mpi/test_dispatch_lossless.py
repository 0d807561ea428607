"""Greedy AR, SD and PipeSpec commit the same tokens under every CPU dispatch level this machine
can run (tests/dispatch_levels.py): the tiny hierarchy in float32 (the CPU kernels' path, three
ranks on two threads each way) at batch 1 and 4, and SmolLM2 behind the suffix drafter."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_all_equal_ar, launch_ok, outputs
from dispatch_levels import levels

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

FLOAT32 = [f"hierarchy.stages.{i}.dtype=float32" for i in range(3)]
METHODS = ("ar", "sd", "pipespec")


@pytest.mark.parametrize("level", list(levels()))
def test_tiny_float32_equal_ar_under_dispatch_level(tmp_path, level):
    recs = launch_ok(
        3,
        ["hierarchy=tiny", *FLOAT32, "run.mode=benchmark", "run.methods=[ar,sd,pipespec]",
         "run.batch_sizes=[1,4]", "decode.max_new_tokens=24", "dataset.n_prompts=4"],
        tmp_path,
        env=levels()[level],
    )  # fmt: skip
    assert_all_equal_ar(recs, {(m, b) for m in METHODS for b in (1, 4)})


@pytest.mark.parametrize(
    "level", [pytest.param(n, marks=pytest.mark.long) if n != "avx2" else n for n in levels()]
)
def test_smollm2_suffix_equal_ar_under_dispatch_level(tmp_path, level):
    recs = launch_ok(
        2,
        ["hierarchy=smollm2_suffix", "dataset=humaneval", "dataset.seed=7", "run.mode=benchmark",
         "run.methods=[ar,sd,pipespec]", "run.warmup_prompts=0", "dataset.n_prompts=2",
         "decode.max_new_tokens=32"],
        tmp_path,
        timeout=600,
        env=levels()[level],
    )  # fmt: skip
    assert_all_equal_ar(recs, {(m, 1) for m in METHODS})
    assert len(outputs(recs)[("ar", 1)]) == 2


def test_a_dispatch_the_cpu_cannot_honour_stops_the_job(tmp_path):
    from conftest import launch

    proc = launch(3, ["hierarchy=tiny"], tmp_path, timeout=120, env={"PIPESPEC_KERNEL_ISA": "sse2"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "PIPESPEC_KERNEL_ISA=sse2 is not one of avx512, avx2" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "results.jsonl").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a node with CUDA")
def test_nccl_on_a_node_without_cuda_stops_the_job(tmp_path):
    from conftest import launch

    proc = launch(3, ["hierarchy=tiny", "transport.kind=nccl"], tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "transport.kind=nccl needs CUDA" in proc.stderr and "Traceback" not in proc.stderr
