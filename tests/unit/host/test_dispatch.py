"""Dispatch settings a CPU cannot honour are errors naming the setting, never a silent fallback
to other numerics (host/dispatch.py); the kernels run the ISA PIPESPEC_KERNEL_ISA asks for."""

from __future__ import annotations

import pytest

from pipespec_mpi.config import compose_config
from pipespec_mpi.host import dispatch

AVX2_CPU = {"sse4_1", "sse4_2", "avx", "avx2", "fma"}
ALL = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "PIPESPEC_KERNEL_ISA")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ALL:
        monkeypatch.delenv(name, raising=False)


def test_nothing_set_nothing_to_say():
    assert dispatch.problems(AVX2_CPU, "AVX2") == []


@pytest.mark.parametrize(
    ("name", "value", "missing"),
    [
        ("ATEN_CPU_CAPABILITY", "avx512", "avx512f"),
        ("MKL_ENABLE_INSTRUCTIONS", "AVX512", "avx512f"),
        ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX", "amx_tile"),
        ("PIPESPEC_KERNEL_ISA", "avx512", "avx512f"),
    ],
)
def test_an_isa_the_cpu_lacks_is_named(monkeypatch, name, value, missing):
    monkeypatch.setenv(name, value)
    (msg,) = dispatch.problems(AVX2_CPU, "AVX2")
    assert msg.startswith(f"{name}={value} asks for") and missing in msg and "avx2" in msg


def test_an_unknown_value_and_a_torch_fallback_are_named(monkeypatch):
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX3")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    msgs = dispatch.problems(AVX2_CPU, "DEFAULT")  # torch did not take what was asked
    assert any(m.startswith("MKL_ENABLE_INSTRUCTIONS=AVX3 is not one of") for m in msgs)
    assert any(m.startswith("ATEN_CPU_CAPABILITY=avx2: torch runs default instead") for m in msgs)
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS")
    assert dispatch.problems(AVX2_CPU, "AVX2") == []


def test_dense_rows_without_amx_is_named():
    hier = compose_config(["hierarchy=smollm2", "hierarchy.stages.1.dense_rows=32"]).hierarchy
    (msg,) = dispatch.dense_problems(hier, AVX2_CPU)
    assert msg.startswith("hierarchy.stages.1.dense_rows=32") and "amx_bf16" in msg
    assert dispatch.dense_problems(hier, AVX2_CPU | {"amx_bf16"}) == []
    assert dispatch.dense_problems(compose_config(["hierarchy=smollm2"]).hierarchy, AVX2_CPU) == []


@pytest.mark.skipif("avx2" not in dispatch.supported_isas(), reason="no AVX2 kernels")
def test_the_kernels_run_the_isa_asked_for(monkeypatch):
    monkeypatch.setenv("PIPESPEC_KERNEL_ISA", "avx2")
    assert dispatch.cpu_isa() == "avx2" and dispatch.dispatch()["kernels"] == "avx2"
    monkeypatch.setenv("PIPESPEC_KERNEL_ISA", "sse2")
    with pytest.raises(dispatch.DispatchError, match="PIPESPEC_KERNEL_ISA=sse2"):
        dispatch.cpu_isa()
