"""What a measurement depends on, and the cache that keeps measurements by it.

Forward costs depend on the machine (CPU model and ISA, GPU, how many cores a rank gets, how many
ranks share the node), the software (torch, this package's CPU kernels) and the models;
agreement depends on the models and the prompts. Each kind is cached under a hash of exactly its
own dependencies, so a second job on the same kind of node skips the cost measurement even for a
new dataset, and a new machine re-measures costs but keeps the agreement of a prompt set it has
seen.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from pipespec_mpi.config import StageConfig

# the ISA extensions that change which kernels torch runs (int8 VNNI, bf16, AMX)
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu_identity() -> dict[str, object]:
    """CPU model and the ISA extensions among ``ISA_FLAGS`` it has (from /proc/cpuinfo)."""
    from pipespec_mpi.host.dispatch import cpu_flags, cpu_model

    flags = cpu_flags()
    return {"cpu": cpu_model(), "isa": [f for f in ISA_FLAGS if f in flags]}


def gpu_identity() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(0)


def machine(cores: int, ranks_on_node: int) -> dict[str, object]:
    """The machine as forward costs see it: CPU, ISA, GPU, the cores the node's ranks share and
    how many ranks share them, torch's version, and this package's CPU kernels (a kernel that
    changes changes the costs, as the row attention kernel did: docs/notebook.md, "Measurements
    behind the code's choices")."""
    import torch

    from pipespec_mpi.models.cpu.flat_linear import kernels_digest

    return {
        **cpu_identity(),
        "gpu": gpu_identity(),
        "cores": cores,
        "ranks_on_node": ranks_on_node,
        "torch": torch.__version__,
        "kernels": kernels_digest(),
    }


def stage_identity(stages: Sequence[StageConfig]) -> list[dict[str, object]]:
    """The candidate stages as their outputs and costs depend on them (every field; threads are
    chosen by the planner and left out)."""
    return [{k: v for k, v in dataclasses.asdict(s).items() if k != "threads"} for s in stages]


def key(parts: Mapping[str, object]) -> str:
    """A short stable hash of a JSON-able mapping."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def cache_dir(configured: str | None) -> Path:
    """``auto.cache_dir``, else $PIPESPEC_CACHE_DIR, else ~/.cache/pipespec_mpi."""
    if configured:
        return Path(configured)
    env = os.environ.get("PIPESPEC_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "pipespec_mpi"


class MeasurementCache:
    """JSON files ``<dir>/auto/<kind>-<key>.json``, each holding what it was measured for (so a
    reader can see the machine or prompts behind a number) and the measurement."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root) / "auto"

    def path(self, kind: str, parts: Mapping[str, object]) -> Path:
        return self.root / f"{kind}-{key(parts)}.json"

    def get(self, kind: str, parts: Mapping[str, object]) -> dict | None:
        p = self.path(kind, parts)
        try:
            node = json.loads(p.read_text())
        except (OSError, ValueError):
            return None  # absent or torn: measure again
        return node.get("value") if node.get("for") == json.loads(json.dumps(parts, default=str)) else None

    def put(self, kind: str, parts: Mapping[str, object], value: Mapping) -> Path:
        p = self.path(kind, parts)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"for": parts, "value": value}, indent=1, default=str))
        os.replace(tmp, p)  # readers never see half a file
        return p
