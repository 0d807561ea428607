"""The device seam: what the device a rank computes on does, in one place.

``current_platform()`` is a ``CpuPlatform`` or a ``CudaPlatform``. Each says which devices a stage
gets, which settings it cannot run (checked once, before any model loads: one message naming
each setting and its fix, exit 2), how to wait for the device, and whether the CPU host's
machinery applies to its ranks (threads and CPU binding, host/placement.py ``CpuPlacement``; a waiting
rank sleeping on the doorbell, host/doorbell.py). The stage loop and the decoding rules
(``stage/``, ``speculative/``) never ask: they compute on whatever tensors their scorer returns.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from pipespec_mpi.config import AppConfig
from pipespec_mpi.config.schema import Transport
from pipespec_mpi.errors import UserError
from pipespec_mpi.topology import device_for


class PlatformError(UserError):
    """A setting this node's device cannot run (the job stops before any model loads)."""


@dataclass(frozen=True)
class RankGpus:
    """One rank of a node as the device seam sees it: its stage and the GPUs it computes on, by
    UUID (the same GPU under every rank's ``CUDA_VISIBLE_DEVICES``) with their compute modes."""

    rank: int
    stage: int
    uuids: tuple[str, ...] = ()
    modes: tuple[str, ...] = ()  # nvidia-smi's compute_mode per GPU ("" where unknown)


def stage_gpus(cfg: AppConfig) -> list[int]:
    """How many GPUs each stage computes on: its ``n_gpus``, none for a model-free stage (a suffix
    or prompt-lookup drafter computes on the host)."""
    h = cfg.hierarchy
    return [0 if i in h.model_free else s.n_gpus for i, s in enumerate(h.stages)]


def shared(node: Sequence[RankGpus]) -> dict[str, list[RankGpus]]:
    """Each GPU two or more of ``node``'s ranks compute on, with those ranks."""
    by_uuid: dict[str, list[RankGpus]] = {}
    for r in node:
        for u in dict.fromkeys(r.uuids):
            by_uuid.setdefault(u, []).append(r)
    return {u: rs for u, rs in by_uuid.items() if len(rs) > 1}


@dataclass(frozen=True)
class CpuPlatform:
    """Ranks on CPU cores: torch threads, CPU binding, the doorbell."""

    kind: str = "cpu"
    cpu_host: bool = True  # threads and binding per rank (CpuPlacement), the doorbell

    def gpus(self, stage_gpus: Sequence[int], stage: int, local_rank: int) -> list[int]:
        return []

    def rank_gpus(self, rank: int, stage: int, devices: Sequence[int]) -> RankGpus:
        return RankGpus(rank, stage)

    def own_gpus(self, node: Sequence[RankGpus]) -> bool:
        return False

    def problems(self, cfg: AppConfig, node: Sequence[RankGpus]) -> list[str]:
        """Settings that need CUDA, on a node without it."""
        out = []
        fix = "this node has no CUDA device (torch.cuda.is_available() is False)"
        if cfg.transport.kind == Transport.nccl:
            out.append(f"transport.kind=nccl needs CUDA and {fix}: use transport.kind=mpi or gloo")
        for i, s in enumerate(cfg.hierarchy.stages):
            if s.device.startswith("cuda"):
                out.append(f"hierarchy.stages.{i}.device={s.device} and {fix}: set it to auto or cpu")
            if s.quantization.startswith("bnb"):
                out.append(
                    f"hierarchy.stages.{i}.quantization={s.quantization} (bitsandbytes) needs CUDA and "
                    f"{fix}: set it to none"
                )
        return out

    def bind(self, devices: Sequence[int]) -> None:
        """Nothing to bind: a CPU rank's threads and cores are host/placement.py's."""

    def synchronize(self) -> None:
        """Nothing to wait for: CPU ops are done when they return."""


EXCLUSIVE = ("Exclusive_Process", "Exclusive_Thread", "Prohibited")  # compute modes no two ranks share


@dataclass(frozen=True)
class CudaPlatform:
    """Ranks on NVIDIA GPUs: a stage's GPUs in stage order among those the rank sees, known
    across ranks by UUID; the rank's current device and its stream."""

    count: int  # GPUs this rank sees (CUDA_VISIBLE_DEVICES)
    uuids: tuple[str, ...] = ()  # per visible index ("" where unknown)
    modes: tuple[str, ...] = ()  # compute mode per visible index ("" where unknown)
    kind: str = "cuda"
    cpu_host: bool = False

    def gpus(self, stage_gpus: Sequence[int], stage: int, local_rank: int) -> list[int]:
        return device_for(list(stage_gpus), stage, local_rank, self.count)

    def rank_gpus(self, rank: int, stage: int, devices: Sequence[int]) -> RankGpus:
        """This rank's GPUs as the others can compare them (a visible index without a known UUID
        is named by it: ranks that see the same devices then agree on it)."""
        uuid = lambda i: self.uuids[i] if i < len(self.uuids) and self.uuids[i] else f"cuda:{i}"  # noqa: E731
        mode = lambda i: self.modes[i] if i < len(self.modes) else ""  # noqa: E731
        return RankGpus(rank, stage, tuple(uuid(i) for i in devices), tuple(mode(i) for i in devices))

    def own_gpus(self, node: Sequence[RankGpus]) -> bool:
        """Whether every rank of the node computes on GPUs no other rank of it uses."""
        return all(r.uuids for r in node) and not shared(node)

    def problems(self, cfg: AppConfig, node: Sequence[RankGpus]) -> list[str]:
        """A stage wider than the GPUs its rank sees; NCCL between ranks without GPUs of their
        own; ranks sharing a GPU whose compute mode admits one process."""
        out = []
        stages = cfg.hierarchy.stages
        for i, (s, n) in enumerate(zip(stages, stage_gpus(cfg), strict=True)):
            if n > self.count:
                out.append(
                    f"hierarchy.stages.{i}.n_gpus={s.n_gpus} but a rank here sees {self.count} GPU(s) "
                    f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): lower it, or "
                    f"give each rank {s.n_gpus} (srun --gpus-per-task={s.n_gpus}, or a node with more)"
                )
        for i, s in enumerate(stages):
            if s.quantization.startswith("bnb") and importlib.util.find_spec("bitsandbytes") is None:
                out.append(
                    f"hierarchy.stages.{i}.quantization={s.quantization} needs bitsandbytes, which is not "
                    "installed (pip install bitsandbytes); or quantization=int4, the engine's own (no "
                    "package)"
                )
        both = shared(node)
        if cfg.transport.kind == Transport.nccl:
            bare = sorted({r.stage for r in node if not r.uuids})
            if bare:
                out.append(
                    f"transport.kind=nccl needs a GPU on every rank and stage(s) {bare} have none "
                    "(a model-free drafter computes on the host): use transport.kind=mpi or auto "
                    "(token ids gain nothing from NCCL)"
                )
            if both:
                out.append(
                    f"transport.kind=nccl puts NCCL between ranks that share a GPU ({_named(both)}): "
                    "NCCL refuses two ranks on one GPU; use transport.kind=mpi (the ranks share the "
                    "GPUs) or more GPUs"
                )
        for uuid, ranks in both.items():
            modes = {m for r in ranks for u, m in zip(r.uuids, r.modes, strict=True) if u == uuid}
            if modes & set(EXCLUSIVE):
                out.append(
                    f"GPU {uuid} is in compute mode {'/'.join(sorted(modes))}, which admits one process, "
                    f"and ranks {[r.rank for r in ranks]} would share it: give each rank its own GPU, or "
                    "ask the site for the Default compute mode (nvidia-smi -c DEFAULT)"
                )
        return out

    def bind(self, devices: Sequence[int]) -> None:
        """Make the rank's first GPU its current device, before any CUDA work: otherwise every
        rank's implicit allocations (and NCCL's) land on cuda:0, each with a context there."""
        import torch

        if devices:
            torch.cuda.set_device(devices[0])

    def synchronize(self) -> None:
        """Wait for the rank's own stream, never the whole device (a device-wide sync waits
        behind a receive posted on another stream, which may never complete meanwhile)."""
        import torch

        torch.cuda.current_stream().synchronize()


def _named(both: dict[str, list[RankGpus]]) -> str:
    return "; ".join(f"ranks {[r.rank for r in rs]} on {u}" for u, rs in both.items())


Platform = CpuPlatform | CudaPlatform


@functools.cache
def current_platform() -> Platform:
    """The platform of this process: CUDA where torch sees a GPU, else the CPU."""
    import torch

    if not torch.cuda.is_available():
        return CpuPlatform()
    n = torch.cuda.device_count()
    uuids = tuple(_uuid(torch.cuda.get_device_properties(i)) for i in range(n))
    modes = compute_modes()
    return CudaPlatform(n, uuids, tuple(modes.get(u, "") for u in uuids))


def _uuid(props) -> str:
    u = str(getattr(props, "uuid", "") or "")
    return u.removeprefix("GPU-")


def compute_modes() -> dict[str, str]:
    """UUID -> compute mode of every GPU ``nvidia-smi`` lists (empty where it cannot say)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=uuid,compute_mode", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {}
    modes = {}
    for line in out.splitlines():
        uuid, _, mode = line.partition(",")
        modes[uuid.strip().removeprefix("GPU-")] = mode.strip()
    return modes


def rank_devices(cfg: AppConfig, world, platform: Platform) -> list[int]:
    """The device indices this rank's stage computes on (none on a CPU or for a model-free stage)."""
    return platform.gpus(stage_gpus(cfg), world.rank % max(1, cfg.hierarchy.n_stages), world.local_rank)


def node_gpus(cfg: AppConfig, world, platform: Platform, devices: Sequence[int]) -> list[RankGpus]:
    """Every rank of this rank's node with the GPUs it takes (``devices``: this rank's,
    ``rank_devices``; collective over ``world.comm``)."""
    mine = platform.rank_gpus(world.rank, world.rank % max(1, cfg.hierarchy.n_stages), devices)
    everyone = world.comm.allgather((world.hosts[world.rank], mine))
    return [r for host, r in everyone if host == world.hosts[world.rank]]


def check(cfg: AppConfig, world, platform: Platform | None = None) -> None:
    """Raise ``PlatformError`` naming every setting this node's device cannot run (collective:
    every rank of the world calls it)."""
    platform = platform or current_platform()
    found = platform.problems(cfg, node_gpus(cfg, world, platform, rank_devices(cfg, world, platform)))
    if found:
        raise PlatformError("; ".join(found))
