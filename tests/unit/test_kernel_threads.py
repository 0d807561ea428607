"""The CPU kernels on several threads: every build really splits its work over the rank's torch
threads (a build without OpenMP silently ran everything on one), and every result is bitwise the
one-thread result whatever the split, so a rank's thread count never changes what is output."""

from __future__ import annotations

import pytest
import torch

from pipespec_mpi.models import flat_linear
from pipespec_mpi.models.attention import rows_kernel
from pipespec_mpi.models.kv_cache import preallocated_cache
from pipespec_mpi.models.lowbit import FORMATS, quantize
from pipespec_mpi.models.lowbit import extension as lowbit_extension
from tests.unit.test_lean import STEPS, lean_for, model_for, run_lean

ISAS = [
    pytest.param(isa, marks=pytest.mark.skipif(flat_linear.extension(isa) is None, reason="no build"))
    for isa in flat_linear.supported_isas()
]
if not ISAS:
    ISAS = [pytest.param(None, marks=pytest.mark.skip(reason="no vector ISA for the kernels"))]

THREADS = (2, 3)  # more threads than this machine's cores is allowed and must not matter


@pytest.fixture
def threads():
    """Run the test body's calls at a given thread count; torch's count restored after."""
    before = torch.get_num_threads()

    def at(n: int, fn, *args):
        torch.set_num_threads(n)
        try:
            return fn(*args)
        finally:
            torch.set_num_threads(before)

    yield at
    torch.set_num_threads(before)


@pytest.mark.parametrize("isa", ISAS)
def test_kernels_use_the_ranks_threads(isa, threads):
    ext = flat_linear.extension(isa)
    assert threads(1, ext.parallel_threads, 64) == 1
    for n in THREADS:
        assert threads(n, ext.parallel_threads, 64) == n


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("n", "k"), [(70, 96), (129, 576), (1536, 576)])
def test_flat_kernel_bitwise_whatever_the_threads(isa, n, k, threads):
    g = torch.Generator().manual_seed(n)
    w, x = torch.randn(n, k, generator=g), torch.randn(16, k, generator=g)
    fn = flat_linear.extension(isa).small_m_linear
    for m in (1, 5, 16):
        one = threads(1, fn, x[:m], w)
        for t in THREADS:
            assert torch.equal(threads(t, fn, x[:m], w), one), (m, t)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_lowbit_kernels_bitwise_whatever_the_threads(isa, fmt, threads):
    g = torch.Generator().manual_seed(7)
    tensors = quantize(torch.randn(257, 576, generator=g), fmt)
    x = torch.randn(20, 576, generator=g)
    fn = getattr(lowbit_extension(isa), f"{fmt}_linear")
    for m in (1, 4, 20):
        one = threads(1, fn, x[:m], *tensors)
        for t in THREADS:
            assert torch.equal(threads(t, fn, x[:m], *tensors), one), (m, t)


@pytest.mark.parametrize("isa", ISAS)
def test_row_attention_bitwise_whatever_the_threads(isa, threads):
    fn = rows_kernel(isa)
    if fn is None:
        pytest.skip("no row attention build")
    g = torch.Generator().manual_seed(1)
    ks = [torch.randn(1, 3, length, 64, generator=g) for length in (300, 17, 41)]
    vs = [torch.randn(1, 3, length, 64, generator=g) for length in (300, 17, 41)]
    q = torch.randn(1, 9, 8, 64, generator=g)  # 8 rows: 1, 4 and 3 from the three sequences
    bounds = [0, 1, 5, 8]
    one = threads(1, fn, q, ks, vs, bounds, 0.125)
    for t in THREADS:
        assert torch.equal(threads(t, fn, q, ks, vs, bounds, 0.125), one), t


def test_lean_forward_bitwise_whatever_the_threads(threads):
    """The whole decoding path of a stage (fused linears, the row kernel's attention; prefill on
    torch's GEMM) gives bitwise the same logits on one thread and on several."""

    def run() -> list[torch.Tensor]:
        model = model_for("tiny", flat=flat_linear.extension() is not None)
        return run_lean(lean_for(model), preallocated_cache(model.config, 64), STEPS)

    one = threads(1, run)
    for t in THREADS:
        for i, (a, b) in enumerate(zip(one, threads(t, run), strict=True)):
            assert torch.equal(a, b), (t, i)


def test_a_build_leaves_the_next_builds_flags_alone(monkeypatch):
    """torch's load_inline extends the ldflags list it is given in place; were that list shared,
    every later kernel of the process would be built with torch's -L/-l flags among its cflags,
    a different command than the same kernel built first in another process, so ranks that
    build in different orders rebuilt each other's kernels at every start (stages loaded in
    30-250 s instead of 2-4)."""
    import torch.utils.cpp_extension as cpp

    seen = []

    def fake_load_inline(name, cpp_sources, functions, extra_cflags, extra_ldflags, verbose):
        seen.append((list(extra_cflags), list(extra_ldflags)))
        extra_ldflags += ["-L/torch/lib", "-lc10"]  # as torch's _prepare_ldflags does
        return object()

    isas = flat_linear.supported_isas()
    if not isas:
        pytest.skip("no vector ISA for the kernels")
    monkeypatch.setenv("PIPESPEC_FLAT_LINEAR", "1")
    monkeypatch.setattr(cpp, "load_inline", fake_load_inline)
    monkeypatch.setattr(flat_linear, "_EXT", {})
    digest = flat_linear.kernels_digest()
    flat_linear.kernels_digest.cache_clear()
    for name in ("first", "second"):
        flat_linear.build(name, "", [], isas[0])
    assert len(seen) == 2
    assert seen[0] == seen[1] and not any(f.startswith(("-L", "-l")) for f in seen[1][0])
    assert flat_linear.kernels_digest() == digest
