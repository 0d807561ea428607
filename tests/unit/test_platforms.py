"""The device seam (platforms.py): what each device cannot run is named before any model loads,
and transport.kind=auto takes NCCL only where the node's ranks have GPUs of their own."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from pipespec_mpi.config import compose_config
from pipespec_mpi.platforms import (
    CpuPlatform,
    CudaPlatform,
    PlatformError,
    check,
    node_gpus,
    rank_devices,
    rows_may_travel,
)


def cfg(*over: str):
    return compose_config(["hierarchy=tiny", *over])


def test_cuda_settings_on_a_cpu_node_are_named():
    msgs = CpuPlatform().problems(
        cfg(
            "transport.kind=nccl",
            "hierarchy.stages.1.device=cuda:0",
            "hierarchy.stages.2.quantization=bnb_4bit",
        ),
        [],
    )
    assert [m.split(" ")[0] for m in msgs] == [
        "transport.kind=nccl",
        "hierarchy.stages.1.device=cuda:0",
        "hierarchy.stages.2.quantization=bnb_4bit",
    ]
    assert all("no CUDA device" in m for m in msgs)
    assert CpuPlatform().problems(cfg(), []) == []


class Node:
    """The ranks of one node, each with what it sees (a fake world: allgather returns them all)."""

    def __init__(self, *sees: CudaPlatform) -> None:
        self.sees = sees
        self.hosts = ("n",) * len(sees)

    def world(self, rank: int) -> SimpleNamespace:
        comm = SimpleNamespace(allgather=lambda mine: [self._of(r, c) for r, c in enumerate(self.sees)])
        return SimpleNamespace(rank=rank, local_rank=rank, hosts=self.hosts, comm=comm)

    def _of(self, rank: int, platform: CudaPlatform, c=None):
        c = c or cfg()
        n = c.hierarchy.n_stages
        devices = rank_devices(c, SimpleNamespace(rank=rank, local_rank=rank), platform)
        return "n", platform.rank_gpus(rank, rank % n, devices)

    def gpus(self, c) -> list:
        world = self.world(0)
        return node_gpus(c, world, self.sees[0], rank_devices(c, world, self.sees[0]))


SHARED_ONE = CudaPlatform(1, ("u0",))  # three ranks seeing the node's one GPU
SHARED_THREE = CudaPlatform(3, ("u0", "u1", "u2"))  # three ranks seeing all three GPUs
PER_TASK = [CudaPlatform(1, (u,)) for u in ("u0", "u1", "u2")]  # srun --gpus-per-task=1


def test_gpus_that_do_not_cover_the_hierarchy_are_named():
    one = Node(SHARED_ONE, SHARED_ONE, SHARED_ONE)
    (msg,) = SHARED_ONE.problems(cfg("hierarchy.stages.2.n_gpus=2"), one.gpus(cfg()))
    assert msg.startswith("hierarchy.stages.2.n_gpus=2 but a rank here sees 1 GPU(s)")
    assert "--gpus-per-task=2" in msg
    (msg,) = SHARED_ONE.problems(cfg("transport.kind=nccl"), one.gpus(cfg()))
    assert "NCCL refuses two ranks on one GPU" in msg and "ranks [0, 1, 2] on u0" in msg
    assert SHARED_ONE.problems(cfg("transport.kind=mpi"), one.gpus(cfg())) == []  # three ranks share it
    three = Node(SHARED_THREE, SHARED_THREE, SHARED_THREE)
    assert SHARED_THREE.problems(cfg("transport.kind=nccl"), three.gpus(cfg())) == []
    with pytest.raises(PlatformError, match="n_gpus=2"):
        check(cfg("hierarchy.stages.0.n_gpus=2"), one.world(0), SHARED_ONE)


def test_ranks_are_told_apart_by_gpu_uuid_not_by_count():
    """Under srun --gpus-per-task each rank sees one GPU, its own: counted, three ranks on one GPU;
    by UUID, each has its own, so NCCL is allowed and auto takes it."""
    node = Node(*PER_TASK)
    gpus = node.gpus(cfg())
    assert [r.uuids for r in gpus] == [("u0",), ("u1",), ("u2",)]
    assert PER_TASK[0].problems(cfg("transport.kind=nccl"), gpus) == []
    assert PER_TASK[0].transport("auto", gpus) == "nccl"


def test_auto_transport_takes_nccl_only_with_a_gpu_per_rank():
    one, three = Node(SHARED_ONE, SHARED_ONE, SHARED_ONE), Node(SHARED_THREE, SHARED_THREE, SHARED_THREE)
    assert SHARED_ONE.transport("auto", one.gpus(cfg())) == "mpi"
    assert SHARED_THREE.transport("auto", three.gpus(cfg())) == "nccl"
    assert CpuPlatform().transport("auto", []) == "mpi"
    assert SHARED_THREE.transport("gloo", three.gpus(cfg())) == "gloo"


def test_auto_sends_token_ids_over_mpi_and_only_rows_over_nccl():
    """Token ids start and end on the host: NCCL only where Leviathan's rows may travel."""
    three = Node(SHARED_THREE, SHARED_THREE, SHARED_THREE).gpus(cfg())
    assert SHARED_THREE.transport("auto", three, rows=False) == "mpi"
    assert SHARED_THREE.transport("nccl", three, rows=False) == "nccl"  # asked for: kept
    assert not rows_may_travel(cfg())  # greedy
    assert rows_may_travel(cfg("sampling.temperature=0.7"))
    assert not rows_may_travel(cfg("sampling.temperature=0.7", "sampling.coupling=gumbel"))
    assert rows_may_travel(cfg("dataset=files", "dataset.path=x.jsonl"))  # a row may sample


def test_a_model_free_stage_needs_no_gpu_and_keeps_nccl_away():
    c = compose_config(["hierarchy=tiny_suffix"])  # suffix -> tiny-mid-3L -> tiny-target-4L
    node = Node(SHARED_THREE, SHARED_THREE, SHARED_THREE)
    node._of = lambda rank, platform, _c=None: Node._of(node, rank, platform, c)
    gpus = node.gpus(c)
    assert gpus[0].uuids == () and gpus[1].uuids == ("u0",)  # the next stages start at the first GPU
    assert SHARED_THREE.transport("auto", gpus) == "mpi"
    (msg,) = SHARED_THREE.problems(replace(c, transport=replace(c.transport, kind="nccl")), gpus)
    assert "stage(s) [0] have none" in msg


def test_ranks_may_not_share_a_gpu_that_admits_one_process():
    exclusive = CudaPlatform(1, ("u0",), ("Exclusive_Process",))
    node = Node(exclusive, exclusive, exclusive)
    (msg,) = exclusive.problems(cfg("transport.kind=mpi"), node.gpus(cfg()))
    assert "compute mode Exclusive_Process" in msg and "ranks [0, 1, 2]" in msg
    own = [CudaPlatform(1, (u,), ("Exclusive_Process",)) for u in ("u0", "u1", "u2")]
    assert own[0].problems(cfg(), Node(*own).gpus(cfg())) == []  # each its own: allowed


def test_a_rank_binds_its_first_gpu_and_waits_for_its_own_stream(monkeypatch):
    import torch

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    stream = SimpleNamespace(synchronize=lambda: calls.append("stream"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("device-wide"))
    SHARED_THREE.bind([2, 3])
    SHARED_THREE.synchronize()
    assert calls == [("set_device", 2), "stream"]


def test_resolve_decides_what_each_rank_runs_once(monkeypatch):
    """``Platform.resolve``: the one place a rank's device, engine plug-ins, compilation,
    transport, threads and waiting are chosen, and what the records carry (``describe``)."""
    bound = []
    monkeypatch.setattr(CudaPlatform, "bind", lambda self, devices: bound.append(list(devices)))
    per_task = Node(*PER_TASK)
    leviathan = cfg("sampling.temperature=0.7", "device.compile=true")
    r = PER_TASK[2].resolve(leviathan, per_task.world(2))
    assert (r.platform, r.devices, r.device, r.kernels, r.compile) == (
        "cuda",
        (0,),
        "cuda:0",
        "portable",
        True,
    )
    assert r.transport == "nccl" and not r.thread_shares and r.waits == "doorbell" and bound == [[0]]
    assert r.describe() == (
        "cuda node, cuda:0: portable kernels, compiled, transport nccl, one thread count, waits by doorbell"
    )
    cpu = Node(CpuPlatform(), CpuPlatform(), CpuPlatform())
    r = CpuPlatform().resolve(cfg("run.doorbell=false"), cpu.world(1))
    assert (r.device, r.kernels, r.transport, r.thread_shares, r.waits) == ("cpu", "cpu", "mpi", True, "poll")
    assert CpuPlatform().resolve(cfg("device.kernels=portable"), cpu.world(1)).kernels == "portable"
    # a CPU copy of the target computes on the CPU kernels on a GPU node too; a drafter on the host
    copies = compose_config(["hierarchy=smollm2_int8"])
    assert copies.hierarchy.stages[0].kind == "int8_copy"
    r = PER_TASK[0].resolve(copies, Node(*PER_TASK[:2]).world(0))
    assert (r.device, r.kernels) == ("cpu", "cpu")
    c = compose_config(["hierarchy=tiny_suffix"])
    r = CpuPlatform().resolve(c, cpu.world(0))
    assert r.device == "host" and r.describe().startswith("cpu node, host: model-free, transport mpi")
    r = CpuPlatform().resolve(cfg("device.compile=true"), cpu.world(1))
    assert not r.compile  # the CPU kernels run eager: only torch's plug-ins compile
    with pytest.raises(PlatformError, match="transport.kind=nccl needs CUDA"):
        CpuPlatform().resolve(cfg("transport.kind=nccl"), cpu.world(0))


def test_the_loader_honours_the_seams_kernels():
    """``device.kernels`` as asked, or as the seam resolved it, picks the same plug-ins."""
    from pipespec_mpi.models.loader import engine_kernels, load_stage

    assert [engine_kernels(k, "cpu") for k in ("auto", "cpu", "portable")] == ["cpu", "cpu", "portable"]
    assert {engine_kernels(k, "cuda:1") for k in ("auto", "cpu", "portable")} == {"portable"}
    hier = cfg().hierarchy
    seam = CpuPlatform().resolve(cfg(), Node(CpuPlatform(), CpuPlatform(), CpuPlatform()).world(2))
    assert seam.kernels == "cpu"
    assert "SiLU by rows" in load_stage(hier, 2, [], seam.kernels).describe()
    assert "SDPA over the slots' grid" in load_stage(hier, 2, [], "portable").describe()
