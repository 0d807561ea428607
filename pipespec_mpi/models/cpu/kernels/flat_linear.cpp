#include "simd.h"

#include <ATen/ThreadLocalState.h>

#include <atomic>

// MKL's per-thread thread count (the C interface; libtorch_cpu exports it where torch is built
// with MKL). Weak: null where torch's BLAS is another library.
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));

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

// y[M, N] = x[M, K] @ w[N, K]^T for any M (a prompt's prefill): torch's GEMM on fixed tiles of
// TILE output columns, each tile one GEMM call that MKL runs on one thread. MKL's own threaded
// GEMM rounds differently with the thread count (and its AVX2 path, the one it takes on AMD CPUs,
// for more shapes); a tile's result depends only on its shape, so y is bitwise the same on any
// number of threads. The tiles are spread over the rank's torch threads.
static const int64_t TILE = 48;  // columns: 576, 192 and 1536 split evenly over 2, 3 or 4 threads

bool tiles_sequential() { return MKL_Set_Num_Threads_Local != nullptr; }

torch::Tensor tiled_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shape mismatch");
  TORCH_CHECK(tiles_sequential(), "tiled_linear needs torch's MKL (MKL_Set_Num_Threads_Local)");
  x = x.contiguous();
  const int64_t M = x.size(0), N = w.size(0), tiles = (N + TILE - 1) / TILE;
  auto y = torch::empty({M, N}, x.options());
  const at::ThreadLocalState caller;  // inference mode and dispatch state, for the pool's threads
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    const at::ThreadLocalStateGuard guard(caller);
    const int before = MKL_Set_Num_Threads_Local(1);  // this thread's GEMM calls run alone
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * TILE, n = std::min(N, n0 + TILE) - n0;
      auto out = y.narrow(1, n0, n);  // rows of stride N: GEMM writes it in place
      at::mm_out(out, x, w.narrow(0, n0, n).t());
    }
    MKL_Set_Num_Threads_Local(before);
  });
  return y;
}

int64_t lanes() { return LANES; }

// How many threads at::parallel_for gives ``tasks`` tasks here: 1 in a build without OpenMP
// (its pragmas ignored), up to torch.get_num_threads() with it. Checks the build, not the math.
int64_t parallel_threads(int64_t tasks) {
  std::atomic<int64_t> seen{0};
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
    seen.fetch_or(int64_t{1} << (at::get_thread_num() & 63));
  });
  return __builtin_popcountll(static_cast<uint64_t>(seen.load()));
}
