"""The device seam (platforms.py): what each device cannot run is named before any model loads,
and transport.kind=auto takes NCCL only where the node's ranks have GPUs of their own."""

from __future__ import annotations

import pytest

from pipespec_mpi.config import compose_config
from pipespec_mpi.platforms import CpuPlatform, CudaPlatform, PlatformError, check, local_stages
from pipespec_mpi.run.setup import resolve_transport


def cfg(*over: str):
    return compose_config(["hierarchy=tiny", *over])


def test_local_stages_are_this_nodes():
    assert local_stages(("a", "a", "a", "b", "b", "b"), 4, 3) == [0, 1, 2]
    assert local_stages(("a", "b", "a", "b"), 2, 2) == [0, 0]


def test_cuda_settings_on_a_cpu_node_are_named():
    msgs = CpuPlatform().problems(
        cfg(
            "transport.kind=nccl",
            "hierarchy.stages.1.device=cuda:0",
            "hierarchy.stages.2.quantization=bnb_4bit",
        ),
        [0, 1, 2],
    )
    assert [m.split(" ")[0] for m in msgs] == [
        "transport.kind=nccl",
        "hierarchy.stages.1.device=cuda:0",
        "hierarchy.stages.2.quantization=bnb_4bit",
    ]
    assert all("no CUDA device" in m for m in msgs)
    assert CpuPlatform().problems(cfg(), [0, 1, 2]) == []


def test_gpus_that_do_not_cover_the_hierarchy_are_named():
    one = CudaPlatform(1)
    (msg,) = one.problems(cfg("hierarchy.stages.2.n_gpus=2"), [2])
    assert msg.startswith("hierarchy.stages.2.n_gpus=2 but this node has 1 GPU(s)")
    (msg,) = one.problems(cfg("transport.kind=nccl"), [0, 1, 2])
    assert "NCCL refuses two ranks on one GPU" in msg and "transport.kind=mpi" in msg
    assert one.problems(cfg("transport.kind=mpi"), [0, 1, 2]) == []  # three ranks share the GPU
    assert CudaPlatform(4).problems(cfg("transport.kind=nccl"), [0, 1, 2]) == []
    with pytest.raises(PlatformError, match="n_gpus=2"):
        check(cfg("hierarchy.stages.0.n_gpus=2"), ("a", "a", "a"), 0, one)


def test_auto_transport_takes_nccl_only_with_a_gpu_per_rank():
    assert resolve_transport("auto", CudaPlatform(1), [1, 1, 1], [0, 1, 2]) == "mpi"
    assert resolve_transport("auto", CudaPlatform(3), [1, 1, 1], [0, 1, 2]) == "nccl"
    assert resolve_transport("auto", CpuPlatform(), [1, 1, 1], [0, 1, 2]) == "mpi"
    assert resolve_transport("gloo", CudaPlatform(3), [1, 1, 1], [0, 1, 2]) == "gloo"
