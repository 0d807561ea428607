"""The device seam: what the device a rank computes on decides, in one place.

``current_platform()`` is a ``CpuPlatform`` or a ``CudaPlatform``, both a ``Platform``. Each
says which devices a stage gets and which settings it cannot run (checked before any model
loads: one message naming each setting and its fix, exit 2); ``Platform.resolve`` then decides,
once per rank, what the rank runs: the transport, the engine's plug-ins and compilation, whether
its torch threads follow each phase's share of the node, and how a waiting rank waits
(``Resolved``: logged, and per stage in every record). The stage loop and the decoding rules
(``stage/``, ``speculative/``) never ask: they compute on whatever tensors their scorer returns.
"""

from __future__ import annotations

import abc
import functools
import importlib.util
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pipespec_mpi.comm.window import check_one_sided
from pipespec_mpi.config import AppConfig
from pipespec_mpi.config.schema import Transport
from pipespec_mpi.errors import UserError
from pipespec_mpi.host.dispatch import check as check_dispatch
from pipespec_mpi.models.loader import engine_kernels, stage_device
from pipespec_mpi.topology import check_world, device_for


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


def rows_may_travel(cfg: AppConfig) -> bool:
    """Whether a job of ``cfg`` may send probability rows between stages: Leviathan sampling,
    at the configured temperature or at a row's own (``dataset=files`` rows may carry one)."""
    may_sample = cfg.sampling.temperature > 0 or cfg.dataset.name in ("files", "jsonl")
    return may_sample and cfg.sampling.coupling == "leviathan"


@dataclass(frozen=True)
class Resolved:
    """What the device seam decided for one rank, before its model loads."""

    platform: str
    """cpu | cuda"""
    devices: tuple[int, ...]
    """the GPU indices its stage computes on (none on a CPU, or for a model-free stage)"""
    device: str
    """where its stage's model computes (cpu, cuda:N; host: a model-free drafter)"""
    transport: Transport
    """what carries its proposals (``transport.kind``, auto resolved)"""
    kernels: Literal["cpu", "portable"]
    """the engine's plug-ins: a CPU's own kernels where they build, or torch's linears and SDPA"""
    compile: bool
    """the engine's forward compiled (``device.compile``, on torch's plug-ins: the CPU kernels run
    eager)"""
    thread_shares: bool
    """its torch threads follow each phase's share of the node (host/placement.py); else one count"""
    waits: Literal["doorbell", "poll"]
    """a waiting rank sleeps until a neighbour rings (host/doorbell.py), or polls with backoff"""

    def describe(self) -> str:
        """One line for the logs and the records."""
        gpus = f" (GPUs {','.join(map(str, self.devices))})" if len(self.devices) > 1 else ""
        threads = "threads by phase" if self.thread_shares else "one thread count"
        built = ", compiled" if self.compile else ""
        engine = "model-free" if self.device == "host" else f"{self.kernels} kernels{built}"
        return (
            f"{self.platform} node, {self.device}{gpus}: {engine}, transport {self.transport}, "
            f"{threads}, waits by {self.waits}"
        )


class Platform(abc.ABC):
    """A kind of device ranks compute on: its devices, what it cannot run, and what it decides."""

    kind: str

    @abc.abstractmethod
    def gpus(self, stage_gpus: Sequence[int], stage: int, local_rank: int) -> list[int]:
        """The device indices a stage's rank computes on."""

    @abc.abstractmethod
    def rank_gpus(self, rank: int, stage: int, devices: Sequence[int]) -> RankGpus:
        """A rank's GPUs as the node's other ranks can compare them."""

    @abc.abstractmethod
    def own_gpus(self, node: Sequence[RankGpus]) -> bool:
        """Whether every rank of the node computes on GPUs no other rank of it uses."""

    @abc.abstractmethod
    def problems(self, cfg: AppConfig, node: Sequence[RankGpus]) -> list[str]:
        """Every setting of ``cfg`` this node's device cannot run, each with its fix."""

    @abc.abstractmethod
    def bind(self, devices: Sequence[int]) -> None:
        """Make ``devices`` the rank's own, before any device work."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait for the rank's own device work."""

    @abc.abstractmethod
    def thread_shares(self) -> bool:
        """Whether a rank's torch threads follow each phase's share of the node."""

    def checked_node(self, cfg: AppConfig, world, devices: Sequence[int]) -> list[RankGpus]:
        """Every rank of this node with its GPUs (``node_gpus``: collective); ``PlatformError``
        naming each setting the node cannot run."""
        node = node_gpus(cfg, world, self, devices)
        found = self.problems(cfg, node)
        if found:
            raise PlatformError("; ".join(found))
        return node

    def transport(self, kind: str, node: Sequence[RankGpus], rows: bool = True) -> Transport:
        """``transport.kind``; auto: NCCL only where the messages may carry rows that live on the
        GPU (``rows``: Leviathan's probability rows) and every rank of this node has GPUs no other
        rank of it uses (by UUID: NCCL refuses two ranks on one GPU, and needs one on every rank);
        else MPI. Token ids start and end on the host, where NCCL would only add a copy each way
        and a kernel."""
        if kind != Transport.auto:
            return Transport(kind)
        return Transport.nccl if rows and self.own_gpus(node) else Transport.mpi

    def resolve(self, cfg: AppConfig, world) -> Resolved:
        """Decide, once, what this rank runs (collective over ``world.comm``): its GPUs bound
        first, the node's settings checked (``PlatformError``), then transport, engine, threads
        and waiting."""
        devices = rank_devices(cfg, world, self)
        self.bind(devices)  # before any CUDA work of this rank
        node = self.checked_node(cfg, world, devices)
        device = stage_device(cfg.hierarchy, world.rank % max(1, cfg.hierarchy.n_stages), devices)
        kernels = engine_kernels(cfg.device.kernels, device)
        return Resolved(
            platform=self.kind,
            devices=tuple(devices),
            device=device,
            transport=self.transport(cfg.transport.kind, node, rows_may_travel(cfg)),
            kernels=kernels,
            compile=cfg.device.compile and kernels == "portable" and device != "host",
            thread_shares=self.thread_shares(),
            waits="doorbell" if cfg.run.doorbell else "poll",
        )


@dataclass(frozen=True)
class CpuPlatform(Platform):
    """Ranks on CPU cores: the CPU's own kernels, torch threads by each phase's share."""

    kind: str = "cpu"

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

    def thread_shares(self) -> bool:
        """The forwards run on the rank's threads: each phase (method, batch, route) takes the
        share of the node that pays for it (host/placement.py)."""
        return True


EXCLUSIVE = ("Exclusive_Process", "Exclusive_Thread", "Prohibited")  # compute modes no two ranks share


@dataclass(frozen=True)
class CudaPlatform(Platform):
    """Ranks on NVIDIA GPUs: a stage's GPUs in stage order among those the rank sees, known
    across ranks by UUID; the rank's current device and its stream."""

    count: int  # GPUs this rank sees (CUDA_VISIBLE_DEVICES)
    uuids: tuple[str, ...] = ()  # per visible index ("" where unknown)
    modes: tuple[str, ...] = ()  # compute mode per visible index ("" where unknown)
    kind: str = "cuda"

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

    def thread_shares(self) -> bool:
        """The forwards run on the GPU: the rank keeps one thread count (a change would only
        make a compiled forward's graphs again)."""
        return False


def _named(both: dict[str, list[RankGpus]]) -> str:
    return "; ".join(f"ranks {[r.rank for r in rs]} on {u}" for u, rs in both.items())


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
    platform.checked_node(cfg, world, rank_devices(cfg, world, platform))


def preflight(cfg: AppConfig, world) -> None:
    """Before any model loads, every check a node can fail, each a ``UserError`` naming its fix
    (collective): the CPU code paths asked for (host/dispatch.py), the device's settings, the
    MPI's one-sided windows (comm/window.py) and the world's size (a plan's, once chosen)."""
    check_dispatch(cfg.hierarchy)
    check(cfg, world)
    check_one_sided(cfg.run.epochs_window)
    if not cfg.hierarchy.choose:
        check_world(world.size, cfg.hierarchy.n_stages)
