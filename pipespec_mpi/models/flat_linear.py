"""Flat-cost verification on CPUs: a small-M float32 matrix multiply that reads each weight once.

A one-token decode step is memory-bound: it streams every weight once. PyTorch's CPU GEMM for
2..16 rows costs 1.5-3x the one-row GEMV on the machines measured here (packing, blocking for
large M), which makes verifying k draft tokens cost up to 2x a plain step and erases most of
speculative decoding's gain. ``small_m_linear`` computes y[M, N] = x[M, K] @ w[N, K]^T with M
accumulators per weight row (AVX2 FMA), so the weights are read from memory once for all rows.

Each output element is the same dot product, accumulated in the same order, whatever M >= 2 is.
One row keeps torch's GEMV (memory-bound already; the AR baseline keeps torch's numerics), so
a 1-token and a k-token forward may round differently, exactly as with stock torch.
The kernel is compiled once per machine (torch.utils.cpp_extension, cached in
~/.cache/torch_extensions); where it cannot be, the model keeps torch's matmul and a warning says so.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("pipespec_mpi")
MAX_ROWS = 16

_CPP = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>

static inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 sh = _mm_movehdup_ps(lo);
  __m128 s = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, s);
  return _mm_cvtss_f32(_mm_add_ss(s, sh));
}

// Two weight rows per pass, M rows of x in L1: every weight is loaded once for all M rows.
// Each output is one dot product accumulated in the same order for any M (and for the tail row).
template <int M>
static void rows(const float* __restrict X, const float* __restrict W, float* __restrict Y,
                 int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t K8 = K & ~int64_t(7);
  int64_t n = n0;
  for (; n + 1 < n1; n += 2) {
    const float* w0 = W + n * K;
    const float* w1 = w0 + K;
    __m256 a0[M], a1[M];
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) { a0[m] = _mm256_setzero_ps(); a1[m] = _mm256_setzero_ps(); }
    for (int64_t k = 0; k < K8; k += 8) {
      __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k);
      _mm_prefetch((const char*)(w0 + k + 2 * K), _MM_HINT_T0);
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) {
        __m256 x = _mm256_loadu_ps(X + m * K + k);
        a0[m] = _mm256_fmadd_ps(v0, x, a0[m]);
        a1[m] = _mm256_fmadd_ps(v1, x, a1[m]);
      }
    }
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      float s0 = hsum(a0[m]), s1 = hsum(a1[m]);
      for (int64_t k = K8; k < K; ++k) { s0 += w0[k] * X[m * K + k]; s1 += w1[k] * X[m * K + k]; }
      Y[m * N + n] = s0;
      Y[m * N + n + 1] = s1;
    }
  }
  for (; n < n1; ++n) {  // tail row: the same accumulation order as above
    const float* w0 = W + n * K;
    __m256 a0[M];
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) a0[m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K8; k += 8) {
      __m256 v0 = _mm256_loadu_ps(w0 + k);
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) a0[m] = _mm256_fmadd_ps(v0, _mm256_loadu_ps(X + m * K + k), a0[m]);
    }
    for (int m = 0; m < M; ++m) {
      float s0 = hsum(a0[m]);
      for (int64_t k = K8; k < K; ++k) s0 += w0[k] * X[m * K + k];
      Y[m * N + n] = s0;
    }
  }
}

template <int M>
static void run(const float* X, const float* W, float* Y, int64_t K, int64_t N) {
  // chunks of an even number of rows, so the pairing (and the rounding) never depends on threads
  at::parallel_for(0, (N + 1) / 2, 128, [&](int64_t p0, int64_t p1) {
    rows<M>(X, W, Y, K, N, 2 * p0, std::min(N, 2 * p1));
  });
}

torch::Tensor small_m_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shape mismatch");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* X = x.data_ptr<float>(); const float* W = w.data_ptr<float>(); float* Y = y.data_ptr<float>();
  switch (M) {
    case 1: run<1>(X, W, Y, K, N); break;   case 2: run<2>(X, W, Y, K, N); break;
    case 3: run<3>(X, W, Y, K, N); break;   case 4: run<4>(X, W, Y, K, N); break;
    case 5: run<5>(X, W, Y, K, N); break;   case 6: run<6>(X, W, Y, K, N); break;
    case 7: run<7>(X, W, Y, K, N); break;   case 8: run<8>(X, W, Y, K, N); break;
    case 9: run<9>(X, W, Y, K, N); break;   case 10: run<10>(X, W, Y, K, N); break;
    case 11: run<11>(X, W, Y, K, N); break; case 12: run<12>(X, W, Y, K, N); break;
    case 13: run<13>(X, W, Y, K, N); break; case 14: run<14>(X, W, Y, K, N); break;
    case 15: run<15>(X, W, Y, K, N); break; case 16: run<16>(X, W, Y, K, N); break;
    default: TORCH_CHECK(false, "small_m_linear: M must be 1..16");
  }
  return y;
}
"""

_ext = None


def _cpu_has_avx2_fma() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


def extension():
    """The compiled kernel module, or None where it cannot be built (reason logged once)."""
    global _ext
    if _ext is None:
        if os.environ.get("PIPESPEC_FLAT_LINEAR", "1") == "0" or not _cpu_has_avx2_fma():
            _ext = False
        else:
            try:
                from torch.utils.cpp_extension import load_inline

                _ext = load_inline(
                    name="pipespec_flat_linear_v2",
                    cpp_sources=[_CPP],
                    functions=["small_m_linear"],
                    extra_cflags=["-O3", "-mavx2", "-mfma"],
                    verbose=False,
                )
            except Exception as err:  # noqa: BLE001 - fall back to torch's matmul
                log.warning("flat-cost linear kernel unavailable (%s); using torch matmul", err)
                _ext = False
    return _ext or None


class FlatLinear(torch.nn.Module):
    """Drop-in for a float32 CPU nn.Linear: the flat kernel for 2..16 rows, torch otherwise."""

    def __init__(self, linear: torch.nn.Linear, kernel) -> None:
        super().__init__()
        self.weight = linear.weight  # [out, in], shared (tied embeddings stay tied)
        self.bias = linear.bias
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        # One row: torch's GEMV is already memory-bound (and AR keeps exactly torch's numerics).
        if rows == 1 or rows > MAX_ROWS or x.dtype != torch.float32:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        y = self.kernel.small_m_linear(x.reshape(rows, x.shape[-1]), self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


def use_flat_linear(model: torch.nn.Module) -> int:
    """Replace the float32 CPU nn.Linear layers of ``model``; returns how many were replaced."""
    kernel = extension()
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
