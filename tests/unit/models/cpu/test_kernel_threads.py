"""The CPU kernels on several threads: every build really splits its work over the rank's torch
threads (a build without OpenMP silently ran everything on one), and every result is bitwise the
one-thread result whatever the split, so a rank's thread count never changes what is output."""

from __future__ import annotations

import os

import pytest
import torch

from pipespec_mpi.config import TinyBaseConfig
from pipespec_mpi.host import dispatch
from pipespec_mpi.models.cpu import flat_linear
from pipespec_mpi.models.cpu.attention import rows_kernel
from pipespec_mpi.models.cpu.lowbit import FORMATS, quantize
from pipespec_mpi.models.cpu.lowbit import extension as lowbit_extension
from pipespec_mpi.stage.batch import score_batch

from .test_plugins import engine_for, model_for

ISAS = [
    pytest.param(isa, marks=pytest.mark.skipif(flat_linear.extension(isa) is None, reason="no build"))
    for isa in dispatch.supported_isas()
]
if not ISAS:
    ISAS = [pytest.param(None, marks=pytest.mark.skip(reason="no vector ISA for the kernels"))]

# every count up to the machine's CPUs, and one more (more threads than cores must not matter)
THREADS = tuple(range(2, (os.cpu_count() or 1) + 2))


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


# SmolLM2's attention shapes (9 query and 3 key heads of 64), and an MLP whose prefill activation
# torch splits over threads mid-vector
WIDE = TinyBaseConfig(hidden_size=576, intermediate_size=1100, num_heads=9, num_kv_heads=3, num_layers=2)


def _stage_logits(base: str) -> list[torch.Tensor]:
    """Every logit row the output stage's scorer (exact rows, as load_stage builds it) computes
    through a prefill of 37 tokens (torch's GEMM in tiles, the row kernel's attention), one-token
    steps, verifications of 2..16 and 21 rows (split in kernel-sized forwards), rollbacks, and
    batched forwards of three slots."""
    sc = engine_for(model_for(WIDE if base == "wide" else base), exact_rows=True)
    assert sc.thread_invariant, "the output stage should run on the CPU kernels alone"
    prompt = [(7 * i) % 250 for i in range(38)]
    out = []
    sc.prefill(prompt, room=64)
    seq = list(prompt)
    for k in (0, 0, 1, 3, *range(5, 17), 20):
        proposal = [(11 * i + k) % 250 for i in range(k)]
        logits = sc.logits(seq, proposal)
        out.append(logits)
        kept = k // 2
        seq = seq + proposal[:kept] + [int(logits[kept].argmax())]
        sc.truncate(len(seq) - 1)
    slots = [sc.for_slot() for _ in range(3)]
    seqs = [prompt[: 20 + 5 * i] for i in range(3)]
    for slot, s in zip(slots, seqs, strict=True):
        slot.prefill(s, room=32)
    for k in (0, 2, 4):
        reqs = [
            (slot, s, [(3 * i + k + j) % 250 for i in range(k + j)])
            for j, (slot, s) in enumerate(zip(slots, seqs))
        ]
        out.extend(score_batch(reqs))
        for slot, s in zip(slots, seqs, strict=True):
            slot.truncate(len(s) - 1)
    return out


@pytest.mark.skipif(not ISAS or flat_linear.extension() is None, reason="no kernel build")
@pytest.mark.parametrize("base", ["tiny", "wide"])
def test_output_stage_bitwise_whatever_the_threads(base, threads):
    """The output stage's logits, bitwise the same on one thread and on every count up to the
    machine's CPUs and beyond: so AR, which computes alone on all of a node's CPUs, and the
    pipelines, whose target computes on its share, commit the same tokens. ("wide": SmolLM2's
    heads, where torch's SDPA rounds a prefill differently by threads, and an MLP whose prefill
    activation torch would split over threads mid-vector.)"""
    one = threads(1, _stage_logits, base)
    for t in THREADS:
        for i, (a, b) in enumerate(zip(one, threads(t, _stage_logits, base), strict=True)):
            assert torch.equal(a, b), (base, t, i)


@pytest.mark.skipif(flat_linear.extension() is None, reason="no kernel build")
@pytest.mark.parametrize("m", [17, 37, 150])
def test_tiled_gemm_bitwise_whatever_the_threads(m, threads):
    """A prefill's linears (torch's GEMM, each tile on one thread): the same bits on any count,
    for shapes torch's own threaded GEMM rounds differently (MKL's AVX2 path: all of them)."""
    ext = flat_linear.extension()
    assert ext.tiles_sequential()
    g = torch.Generator().manual_seed(m)
    for n, k in ((576, 576), (192, 576), (1536, 576), (250, 64), (100, 64)):
        x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
        one = threads(1, ext.tiled_linear, x, w)
        assert torch.allclose(one, x @ w.T, atol=1e-4, rtol=1e-4)
        for t in THREADS:
            assert torch.equal(threads(t, ext.tiled_linear, x, w), one), (n, k, t)


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

    isas = dispatch.supported_isas()
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
