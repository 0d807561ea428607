"""Flat-cost verification on CPUs: a small-M float32 matrix multiply that reads each weight once.

A one-token decode step is memory-bound: it streams every weight once. PyTorch's CPU GEMM for
2..16 rows costs 1.5-3.5x the one-row GEMV on the machines measured here (packing, blocking for
large M), which makes verifying k draft tokens cost up to 2x a plain step and erases most of
speculative decoding's gain. ``small_m_linear`` computes y[M, N] = x[M, K] @ w[N, K]^T for
1..16 rows: two weight rows per pass, up to GROUP rows of x against them (AVX-512 or AVX2 FMA,
chosen by the CPU), and software prefetch of the rows a few passes ahead, so the weights are
streamed from memory once for all rows at close to the one-row speed.

Every output element is the same dot product accumulated in the same order whatever M is, so a
row's result does not depend on how many rows travel with it: a one-token step (AR) and a k-token
verification compute bitwise the same linear layers for the same inputs. The kernel is compiled
once per machine and ISA (torch.utils.cpp_extension, cached in ~/.cache/torch_extensions); where
it cannot be, the model keeps torch's matmul and a warning says so.
"""

from __future__ import annotations

import logging
import os
import types

import torch

log = logging.getLogger("pipespec_mpi")
MAX_ROWS = 16

_PREAMBLE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>

#ifndef PREFETCH
#define PREFETCH 8192   // floats ahead of the weights being read (32 KB), into L2
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_T1
#endif
#ifndef X_IN_L1
#define X_IN_L1 6144    // floats of x one pass may keep in L1 (24 KB)
#endif

// One SIMD vector of floats: 16 lanes with AVX-512 (32 registers), 8 with AVX2 (16 registers).
#if defined(__AVX512F__)
typedef __m512 vec;
static const int LANES = 16;
static const int GROUP = 14;  // x rows per pass: 2*14 accumulators + 2 weights + 1 x <= 32 registers
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float hsum(vec v) {
  __m256 lo = _mm512_castps512_ps256(v);
  __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  __m256 s8 = _mm256_add_ps(lo, hi);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 sh = _mm_movehdup_ps(s4);
  __m128 s = _mm_add_ps(s4, sh);
  sh = _mm_movehl_ps(sh, s);
  return _mm_cvtss_f32(_mm_add_ss(s, sh));
}
#else
typedef __m256 vec;
static const int LANES = 8;
static const int GROUP = 6;  // 2*6 accumulators + 2 weights + 1 x <= 16 registers
static inline vec vzero() { return _mm256_setzero_ps(); }
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float hsum(vec v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 sh = _mm_movehdup_ps(lo);
  __m128 s = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, s);
  return _mm_cvtss_f32(_mm_add_ss(s, sh));
}
#endif

"""

_CPP = (
    _PREAMBLE
    + r"""
// Output rows [n0, n1) for G rows of x, two weight rows per pass: each weight vector is loaded
// once for the G rows (the two rows, a few KB, stay in L1 for the next group). Every output
// Y[m, n] is the same dot product accumulated in the same order (LANES partial sums over k, then
// hsum, then the scalar tail) whatever M, G or the thread split are.
template <int G>
static void group_rows(const float* __restrict X, const float* __restrict W, float* __restrict Y,
                       int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t KV = K - K % LANES;
  int64_t n = n0;
  for (; n + 1 < n1; n += 2) {
    const float* w0 = W + n * K;
    const float* w1 = w0 + K;
    vec a0[G], a1[G];
#pragma GCC unroll 16
    for (int m = 0; m < G; ++m) { a0[m] = vzero(); a1[m] = vzero(); }
    for (int64_t k = 0; k < KV; k += LANES) {
      vec v0 = vload(w0 + k), v1 = vload(w1 + k);
      _mm_prefetch((const char*)(w0 + PREFETCH + k), PREFETCH_HINT);  // rows a few passes ahead
      _mm_prefetch((const char*)(w1 + PREFETCH + k), PREFETCH_HINT);
#pragma GCC unroll 16
      for (int m = 0; m < G; ++m) {
        vec x = vload(X + m * K + k);
        a0[m] = vfma(v0, x, a0[m]);
        a1[m] = vfma(v1, x, a1[m]);
      }
    }
#pragma GCC unroll 16
    for (int m = 0; m < G; ++m) {
      float s0 = hsum(a0[m]), s1 = hsum(a1[m]);
      for (int64_t k = KV; k < K; ++k) { s0 += w0[k] * X[m * K + k]; s1 += w1[k] * X[m * K + k]; }
      Y[m * N + n] = s0;
      Y[m * N + n + 1] = s1;
    }
  }
  for (; n < n1; ++n) {  // odd last row: the same accumulation order as above
    const float* w0 = W + n * K;
    vec a0[G];
#pragma GCC unroll 16
    for (int m = 0; m < G; ++m) a0[m] = vzero();
    for (int64_t k = 0; k < KV; k += LANES) {
      vec v0 = vload(w0 + k);
#pragma GCC unroll 16
      for (int m = 0; m < G; ++m) a0[m] = vfma(v0, vload(X + m * K + k), a0[m]);
    }
    for (int m = 0; m < G; ++m) {
      float s0 = hsum(a0[m]);
      for (int64_t k = KV; k < K; ++k) s0 += w0[k] * X[m * K + k];
      Y[m * N + n] = s0;
    }
  }
}

typedef void (*group_fn)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);

template <int G>
static void fill(group_fn* t) { t[G] = group_rows<G>; if constexpr (G > 1) fill<G - 1>(t); }

struct Table {  // group_rows<G> for G = 1..GROUP
  group_fn f[GROUP + 1];
  Table() { f[0] = nullptr; fill<GROUP>(f); }
};

static const Table& table() { static const Table t; return t; }  // thread-safe initialisation

// Blocks of 2*BLOCK weight rows (even, so the pairing never depends on threads); inside a block,
// x is taken GROUP rows at a time while the block's weights are still in cache.
static void run(const float* X, const float* W, float* Y, int64_t M, int64_t K, int64_t N) {
  const int64_t BLOCK = 32;
  // x rows per pass: as many as the registers allow while the group (G*K floats) stays in L1
  const int64_t g_max = std::max<int64_t>(1, std::min<int64_t>(GROUP, X_IN_L1 / K));
  const Table& tab = table();
  at::parallel_for(0, (N + 2 * BLOCK - 1) / (2 * BLOCK), 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * 2 * BLOCK, n1 = std::min(N, n0 + 2 * BLOCK);
      for (int64_t m0 = 0; m0 < M; m0 += g_max) {
        const int64_t g = std::min<int64_t>(g_max, M - m0);
        tab.f[g](X + m0 * K, W, Y + m0 * N, K, N, n0, n1);
      }
    }
  });
}

torch::Tensor small_m_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shape mismatch");
  TORCH_CHECK(w.is_contiguous(), "weight must be contiguous");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  run(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), M, K, N);
  return y;
}

int64_t lanes() { return LANES; }
"""
)

_EXT: dict[str, object] = {}  # name_ISA -> compiled module, or None where it failed to build


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((ln for ln in f if ln.startswith("flags")), "").split())
    except OSError:
        return set()


def cpu_isa() -> str | None:
    """The widest vector ISA the kernel has a build for: "avx512", "avx2", or None."""
    flags = cpu_flags()
    if {"avx512f", "avx512vl", "fma"} <= flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return None


_ISA_FLAGS = {"avx512": ["-mavx512f", "-mavx512vl", "-mavx2", "-mfma"], "avx2": ["-mavx2", "-mfma"]}


def supported_isas() -> list[str]:
    """The kernel builds this CPU can run, widest first."""
    isa = cpu_isa()
    return {"avx512": ["avx512", "avx2"], "avx2": ["avx2"]}.get(isa or "", [])


def build(name: str, source: str, functions: list[str], isa: str | None, cflags: tuple[str, ...] = ()):
    """Compile ``source`` for ``isa`` once per machine (cached by torch in
    ~/.cache/torch_extensions), or None where it cannot be built (the reason is logged once).
    PIPESPEC_FLAT_LINEAR=0 turns every kernel off."""
    isa = isa or cpu_isa()
    if os.environ.get("PIPESPEC_FLAT_LINEAR", "1") == "0" or isa not in supported_isas():
        return None
    key = f"{name}_{isa}"
    if key not in _EXT:
        try:
            from torch.utils.cpp_extension import load_inline

            _EXT[key] = load_inline(
                name=key,
                cpp_sources=[source],
                functions=functions,
                extra_cflags=["-O3", *_ISA_FLAGS[isa], *cflags],
                verbose=False,
            )
        except Exception as err:  # noqa: BLE001 - the caller falls back to torch
            log.warning("kernel %s unavailable (%s); using torch", key, err)
            _EXT[key] = None
    return _EXT[key]


def extension(isa: str | None = None):
    """The compiled float32 kernel for ``isa`` (default: the widest this CPU has), or None."""
    return build("pipespec_flat_linear_v3", _CPP, ["small_m_linear", "lanes"], isa)


class FlatLinear(torch.nn.Module):
    """Drop-in for a float32 CPU nn.Linear: the flat kernel for 1..16 rows, torch otherwise."""

    def __init__(self, linear: torch.nn.Linear, kernel) -> None:
        super().__init__()
        self.weight = linear.weight  # [out, in], shared (tied embeddings stay tied)
        self.bias = linear.bias
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        # More rows (a long prompt's prefill): torch's blocked GEMM is the better kernel.
        if rows > MAX_ROWS or x.dtype != torch.float32:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        y = self.kernel.small_m_linear(x.reshape(rows, x.shape[-1]), self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @classmethod
    def concat(cls, parts: list[FlatLinear]) -> FlatLinear | None:
        """One layer computing ``parts`` side by side (outputs concatenated on the last dim), or
        None. Every output is the same dot product as in its part, so the result is bitwise the
        parts' outputs; the parts' weights become views of the fused one (no extra memory)."""
        if any(p.bias is not None or p.kernel is not parts[0].kernel for p in parts):
            return None
        fused = torch.cat([p.weight.detach() for p in parts])  # [sum N, K]
        start = 0
        for p in parts:
            n = p.weight.shape[0]
            p.weight = torch.nn.Parameter(fused[start : start + n], requires_grad=False)
            start += n
        return cls(types.SimpleNamespace(weight=fused, bias=None), parts[0].kernel)


def fuse_linears(parts: list[torch.nn.Module]) -> torch.nn.Module | None:
    """One layer whose output is the concatenation of ``parts``' outputs, bitwise, or None where
    they cannot be fused (different kinds, biases, kernels). Layers of kinds that define
    ``concat`` (FlatLinear, lowbit.LowBitLinear) can be."""
    kind = type(parts[0])
    if len(parts) < 2 or any(type(p) is not kind for p in parts) or not hasattr(kind, "concat"):
        return None
    return kind.concat(parts)


def use_flat_linear(model: torch.nn.Module, isa: str | None = None) -> int:
    """Replace the float32 CPU nn.Linear layers of ``model``; returns how many were replaced."""
    kernel = extension(isa)
    if kernel is None:
        return 0
    count = 0
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            if (
                type(child) is torch.nn.Linear
                and child.weight.dtype == torch.float32
                and child.weight.device.type == "cpu"
            ):
                setattr(parent, name, FlatLinear(child, kernel))
                count += 1
    return count
