"""Which CPU code paths a rank's arithmetic runs, as the environment asks for them, checked.

torch (``ATEN_CPU_CAPABILITY``), MKL (``MKL_ENABLE_INSTRUCTIONS``), oneDNN (``ONEDNN_MAX_CPU_ISA``)
and the project's kernels (``PIPESPEC_KERNEL_ISA``) each pick a vector ISA; a setting lowers the
choice. Asked for an ISA the CPU lacks, each library falls back silently to another, so a run
would compute with other numerics than it says: ``problems`` names every such setting instead,
and the job stops on it before any model loads. ``dispatch`` is what a run records.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pipespec_mpi.errors import UserError

if TYPE_CHECKING:
    from pipespec_mpi.config import HierarchyConfig


class DispatchError(UserError):
    """A dispatch setting this CPU cannot honour (the job stops before any model loads)."""


# The CPU flags each setting's values need (values compared upper-case, as the libraries read them).
_ATEN = {"DEFAULT": (), "AVX2": ("avx2", "fma"), "AVX512": ("avx512f", "avx512bw", "avx512vl", "avx512dq")}
_MKL = {
    "SSE4_2": ("sse4_2",),
    "AVX": ("avx",),
    "AVX2": ("avx2", "fma"),
    "AVX512": ("avx512f",),
    "AVX512_E1": ("avx512f", "avx512_vnni"),
    "AVX512_E4": ("avx512f", "avx512_bf16"),
}
_ONEDNN = {
    "SSE41": ("sse4_1",),
    "AVX": ("avx",),
    "AVX2": ("avx2",),
    "AVX2_VNNI": ("avx2", "avx_vnni"),
    "AVX512_CORE": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "AVX512_CORE_VNNI": ("avx512f", "avx512_vnni"),
    "AVX512_CORE_BF16": ("avx512f", "avx512_bf16"),
    "AVX512_CORE_FP16": ("avx512f", "avx512_fp16"),
    "AVX512_CORE_AMX": ("amx_tile", "amx_bf16", "amx_int8"),
    "AVX512_CORE_AMX_FP16": ("amx_tile", "amx_bf16", "amx_fp16"),
    "ALL": (),
    "DEFAULT": (),
}
_KERNELS = {"AVX512": ("avx512f", "avx512vl", "fma"), "AVX2": ("avx2", "fma")}
SETTINGS = {
    "ATEN_CPU_CAPABILITY": _ATEN,
    "MKL_ENABLE_INSTRUCTIONS": _MKL,
    "ONEDNN_MAX_CPU_ISA": _ONEDNN,
    "PIPESPEC_KERNEL_ISA": _KERNELS,
}


@functools.cache
def cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (read once per process; {} where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                k, _, v = line.partition(":")
                fields.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    return fields


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo has none)."""
    return frozenset(cpuinfo().get("flags", "").split())


def cpu_model() -> str:
    """The CPU's model name (the platform's processor or machine where /proc/cpuinfo has none)."""
    import platform

    return cpuinfo().get("model name") or platform.processor() or platform.machine()


def widest_isa() -> str | None:
    """The widest vector ISA the kernels have a build for on this CPU: "avx512", "avx2", or None."""
    flags = cpu_flags()
    if {"avx512f", "avx512vl", "fma"} <= flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return None


def cpu_isa() -> str | None:
    """The ISA the kernels run: ``PIPESPEC_KERNEL_ISA`` where set (one this CPU runs, else a
    ``DispatchError``), the widest otherwise."""
    forced = kernel_isa_setting()
    if forced is None:
        return widest_isa()
    if forced not in supported_isas():
        raise DispatchError(
            f"PIPESPEC_KERNEL_ISA={forced}: this CPU runs {supported_isas() or 'no'} kernel builds"
        )
    return forced


def supported_isas() -> list[str]:
    """The kernel builds this CPU can run, widest first."""
    return {"avx512": ["avx512", "avx2"], "avx2": ["avx2"]}.get(widest_isa() or "", [])


def kernel_isa_setting() -> str | None:
    """``PIPESPEC_KERNEL_ISA`` lower-cased ("avx512", "avx2"), or None where unset."""
    value = os.environ.get("PIPESPEC_KERNEL_ISA", "").strip().lower()
    return value or None


def problems(flags: Iterable[str], torch_capability: str | None = None) -> list[str]:
    """Every dispatch setting this CPU (its ``flags``) cannot honour, one sentence each naming the
    setting and the fix. ``torch_capability``: what torch reports it runs (checked against
    ``ATEN_CPU_CAPABILITY``: torch falls back without a word)."""
    have = set(flags)
    out = []
    for name, table in SETTINGS.items():
        raw = os.environ.get(name, "").strip()
        if not raw:
            continue
        value = raw.upper()
        if value not in table:
            out.append(
                f"{name}={raw} is not one of {', '.join(v.lower() for v in table)}: unset it or pick one"
            )
            continue
        missing = [f for f in table[value] if f not in have]
        lower = ", ".join(v.lower() for v in table if all(f in have for f in table[v]))
        if missing:
            out.append(
                f"{name}={raw} asks for instructions this CPU does not have ({', '.join(missing)}): "
                f"unset it, or set one it has ({lower})"
            )
        elif name == "ATEN_CPU_CAPABILITY" and torch_capability and torch_capability.upper() != value:
            runs = torch_capability.lower()
            out.append(f"{name}={raw}: torch runs {runs} instead; unset it or set {runs}")
    return out


def dense_problems(hier: HierarchyConfig, flags: Iterable[str]) -> list[str]:
    """Stages whose ``dense_rows`` asks for the AMX GEMM on a CPU without AMX tiles."""
    have = set(flags)
    out = []
    for i, stage in enumerate(hier.stages):
        if stage.kind != "lowbit_copy" or not stage.dense_rows:
            continue
        need = "amx_int8" if stage.weights == "w8a8" else "amx_bf16"
        if need not in have:
            out.append(
                f"hierarchy.stages.{i}.dense_rows={stage.dense_rows} runs torch's GEMM on AMX tiles "
                f"({need}), which this CPU lacks: set it to 0 (never) or null (by CPU)"
            )
    return out


def check(hier: HierarchyConfig) -> None:
    """Raise ``DispatchError`` naming every setting this CPU cannot honour (see ``problems``)."""
    import torch

    found = problems(cpu_flags(), torch.backends.cpu.get_cpu_capability()) + dense_problems(hier, cpu_flags())
    if found:
        raise DispatchError("; ".join(found))


def dispatch() -> dict[str, str]:
    """The CPU code paths this process runs: torch's capability, the kernels' ISA, and the
    libraries' caps where set (what a run's records say it computed with)."""
    import torch

    out = {"torch": torch.backends.cpu.get_cpu_capability(), "kernels": cpu_isa() or "none"}
    for name in ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA"):
        if os.environ.get(name):
            out[name] = os.environ[name]
    return out
