"""The CPU dispatch levels this machine can run, as environments: what another machine's torch,
MKL, oneDNN and kernels would compute with (tests/unit/host/test_dispatch_levels.py, tests/mpi)."""

from __future__ import annotations

from pipespec_mpi.host.dispatch import supported_isas

AVX2 = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "PIPESPEC_KERNEL_ISA": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}


def levels() -> dict[str, dict[str, str]]:
    """Name -> environment: the machine as it is; where the CPU has AVX-512, an AVX2-only CPU
    (every library capped at AVX2, the kernels' AVX2 build; on an AVX2-only CPU that is the
    machine as it is) and MKL on its AVX2 path beside AVX-512 torch and kernels (what MKL takes on
    AMD CPUs); torch's scalar dispatch."""
    isas = supported_isas()
    out: dict[str, dict[str, str]] = {"native": {}}
    if "avx512" in isas:
        out["avx2"] = AVX2
        out["mkl-avx2"] = {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    out["torch-default"] = {"ATEN_CPU_CAPABILITY": "default"}
    return out
