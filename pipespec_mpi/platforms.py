"""The device seam: what the device a rank computes on does, in one place.

``current_platform()`` is a ``CpuPlatform`` or a ``CudaPlatform``. Each says which devices a stage
gets, which settings it cannot run (checked once, before any model loads: one message naming
each setting and its fix, exit 2), how to wait for the device, and whether the CPU host's
machinery applies to its ranks (threads and CPU binding, host/placement.py ``CpuPlacement``; a waiting
rank sleeping on the doorbell, host/doorbell.py). The stage loop and the decoding rules
(``stage/``, ``speculative/``) never ask: they compute on whatever tensors their scorer returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipespec_mpi.config import AppConfig
from pipespec_mpi.errors import UserError
from pipespec_mpi.topology import device_for


class PlatformError(UserError):
    """A setting this node's device cannot run (the job stops before any model loads)."""


def local_stages(hosts: Sequence[str], rank: int, n_stages: int) -> list[int]:
    """The stage of every rank on this rank's node, in rank order."""
    return [r % n_stages for r, h in enumerate(hosts) if h == hosts[rank]]


@dataclass(frozen=True)
class CpuPlatform:
    """Ranks on CPU cores: torch threads, CPU binding, the doorbell."""

    kind: str = "cpu"
    cpu_host: bool = True  # threads and binding per rank (CpuPlacement), the doorbell

    def gpus(self, stage_gpus: Sequence[int], stage: int, local_rank: int) -> list[int]:
        return []

    def own_gpus(self, stage_gpus: Sequence[int], stages_here: Sequence[int]) -> bool:
        return False

    def problems(self, cfg: AppConfig, stages_here: Sequence[int]) -> list[str]:
        """Settings that need CUDA, on a node without it."""
        out = []
        fix = "this node has no CUDA device (torch.cuda.is_available() is False)"
        if cfg.transport.kind == "nccl":
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

    def synchronize(self) -> None:
        """Nothing to wait for: CPU ops are done when they return."""


@dataclass(frozen=True)
class CudaPlatform:
    """Ranks on NVIDIA GPUs: a stage's GPUs in stage order, the device's stream to wait for."""

    count: int
    kind: str = "cuda"
    cpu_host: bool = False

    def gpus(self, stage_gpus: Sequence[int], stage: int, local_rank: int) -> list[int]:
        return device_for(list(stage_gpus), stage, local_rank, self.count)

    def problems(self, cfg: AppConfig, stages_here: Sequence[int]) -> list[str]:
        """A stage wider than the node's GPUs; NCCL between ranks that would share a GPU."""
        out = []
        stages = cfg.hierarchy.stages
        for i, s in enumerate(stages):
            if s.n_gpus > self.count:
                out.append(
                    f"hierarchy.stages.{i}.n_gpus={s.n_gpus} but this node has {self.count} GPU(s): "
                    f"lower it, or run on a node with {s.n_gpus}"
                )
        gpus = [s.n_gpus for s in stages]
        if cfg.transport.kind == "nccl" and not self.own_gpus(gpus, stages_here):  # (auto takes MPI)
            out.append(
                f"transport.kind=nccl puts NCCL between {len(stages_here)} ranks here, which need "
                f"{sum(gpus[s] for s in stages_here)} GPUs and this node has {self.count}: NCCL refuses "
                "two ranks on one GPU; use transport.kind=mpi (the ranks share the GPUs) or more GPUs"
            )
        return out

    def own_gpus(self, stage_gpus: Sequence[int], stages_here: Sequence[int]) -> bool:
        """Whether the node's ranks (their stages) each get GPUs of their own."""
        return sum(stage_gpus[s] for s in stages_here) <= self.count

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()


Platform = CpuPlatform | CudaPlatform


def current_platform() -> Platform:
    """The platform of this process: CUDA where torch sees a GPU, else the CPU."""
    import torch

    if torch.cuda.is_available():
        return CudaPlatform(torch.cuda.device_count())
    return CpuPlatform()


def check(cfg: AppConfig, hosts: Sequence[str], rank: int, platform: Platform | None = None) -> None:
    """Raise ``PlatformError`` naming every setting this node's device cannot run."""
    platform = platform or current_platform()
    found = platform.problems(cfg, local_stages(hosts, rank, max(1, cfg.hierarchy.n_stages)))
    if found:
        raise PlatformError("; ".join(found))
