#include "simd.h"

#include <cstdint>
#include <cmath>
#include <vector>

// A weight format gives row n's weights at columns [k, k + LANES) as floats (k a multiple of
// LANES; K a multiple of 32) and a per-row factor applied to the finished dot product.
#if defined(__AVX512F__)
static inline vec cvt_u16_to_f32_hi(const uint16_t* p) {  // bf16 -> f32: shift into the top half
  __m512i i = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(i, 16));
}
static inline vec cvt_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
static inline vec cvt_nibbles(const uint8_t* p, bool high) {
  __m512i i = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  i = high ? _mm512_srli_epi32(i, 4) : _mm512_and_si512(i, _mm512_set1_epi32(15));
  return _mm512_cvtepi32_ps(i);
}
#else
static inline vec cvt_u16_to_f32_hi(const uint16_t* p) {
  __m256i i = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(i, 16));
}
static inline vec cvt_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
static inline vec cvt_nibbles(const uint8_t* p, bool high) {
  __m256i i = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  i = high ? _mm256_srli_epi32(i, 4) : _mm256_and_si256(i, _mm256_set1_epi32(15));
  return _mm256_cvtepi32_ps(i);
}
#endif

#ifndef AHEAD_BYTES
#define AHEAD_BYTES 8192  // prefetch distance: 8-32 KB best (int8 linears 12.8 ms at 2 KB, 8.0 at 8 KB)
#endif
static inline void prefetch(const void* p) {
  _mm_prefetch((const char*)p + AHEAD_BYTES, PREFETCH_HINT);
}

struct BF16 {  // [N, K] bfloat16
  const uint16_t* w; int64_t K;
  vec load(int64_t n, int64_t k) const { return cvt_u16_to_f32_hi(w + n * K + k); }
  void ahead(int64_t n, int64_t k) const { prefetch(w + n * K + k); }
  float factor(int64_t) const { return 1.0f; }
};
struct I8 {  // [N, K] int8, s[N]
  const int8_t* w; const float* s; int64_t K;
  vec load(int64_t n, int64_t k) const { return cvt_i8(w + n * K + k); }
  void ahead(int64_t n, int64_t k) const { prefetch(w + n * K + k); }
  float factor(int64_t n) const { return s[n]; }
};
struct Q8 {  // [N, K] int8, d[N, K/32]: w = q * d
  const int8_t* w; const float* d; int64_t K;
  vec load(int64_t n, int64_t k) const {
    return vmul(cvt_i8(w + n * K + k), vset1(d[n * (K / 32) + k / 32]));
  }
  void ahead(int64_t n, int64_t k) const { prefetch(w + n * K + k); }
  float factor(int64_t) const { return 1.0f; }
};
struct Q4 {  // [N, K/2] nibbles (block b: byte i = q[32b+i] | q[32b+16+i] << 4), d, m [N, K/32]
  const uint8_t* w; const float* d; const float* m; int64_t K;
  vec load(int64_t n, int64_t k) const {
    const int64_t b = n * (K / 32) + k / 32, j = k % 32;
    vec q = cvt_nibbles(w + n * (K / 2) + (k / 32) * 16 + (j & 15), j >= 16);
    return vadd(vmul(q, vset1(d[b])), vset1(m[b]));  // as gguf-py: (d * q) + m, two roundings
  }
  void ahead(int64_t n, int64_t k) const { prefetch(w + n * (K / 2) + k / 2); }
  float factor(int64_t) const { return 1.0f; }
};

// Columns [k, k + 2 LANES) of row n (k a multiple of 2 LANES): two loads, or one conversion for
// both where a format has a cheaper way.
template <class F>
static inline void load2(const F& f, int64_t n, int64_t k, vec& lo, vec& hi) {
  lo = f.load(n, k);
  hi = f.load(n, k + LANES);
}
#if defined(__AVX512F__)
// Q4 with 16 lanes: a block of 32 weights is one 16-byte load whose low nibbles are columns
// [k, k + 16) and high nibbles [k + 16, k + 32), and a block has only 16 distinct values
// d * q + m. They are computed once (rounded exactly as load() rounds each weight) into one
// register, and every weight is a permutation of it (vpermps reads an index's bits [3:0]):
// 6 vector operations for 32 weights instead of 10, bitwise the same weights. The q4 linears of
// the SmolLM2 target over 1 / 4 / 8 / 16 rows: 13.2 / 19.8 / 29.6 / 57.4 ms -> 10.1-10.5 /
// 14.6-15.3 / 23.9-24.3 / 45.4 ms (one thread, 2-core Xeon with AMX, 2026-12-04).
static inline void load2(const Q4& f, int64_t n, int64_t k, vec& lo, vec& hi) {
  const int64_t b = n * (f.K / 32) + k / 32;
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(f.w + n * (f.K / 2) + (k / 32) * 16)));
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const vec values = vadd(vmul(iota, vset1(f.d[b])), vset1(f.m[b]));
  lo = _mm512_permutexvar_ps(q, values);
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), values);
}
#endif

// Output rows [n0, n1) for G rows of x: as the float32 kernel's group_rows, with the weights
// converted in registers once for the G rows.
template <class F, int G>
static void rows_q(const F& f, const float* __restrict X, float* __restrict Y, int64_t K, int64_t N,
                   int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 1 < n1; n += 2) {
    vec a0[G], a1[G];
#pragma GCC unroll 16
    for (int m = 0; m < G; ++m) { a0[m] = vzero(); a1[m] = vzero(); }
    for (int64_t k = 0; k < K; k += 2 * LANES) {  // K is a multiple of 32
      vec v0, w0, v1, w1;
      load2(f, n, k, v0, w0);
      load2(f, n + 1, k, v1, w1);
      f.ahead(n, k);
      f.ahead(n + 1, k);
#pragma GCC unroll 16
      for (int m = 0; m < G; ++m) {
        vec x = vload(X + m * K + k);
        a0[m] = vfma(v0, x, a0[m]);
        a1[m] = vfma(v1, x, a1[m]);
      }
#pragma GCC unroll 16
      for (int m = 0; m < G; ++m) {  // the next LANES columns: each sum still runs in k order
        vec x = vload(X + m * K + k + LANES);
        a0[m] = vfma(w0, x, a0[m]);
        a1[m] = vfma(w1, x, a1[m]);
      }
    }
    const float s0 = f.factor(n), s1 = f.factor(n + 1);
#pragma GCC unroll 16
    for (int m = 0; m < G; ++m) {
      Y[m * N + n] = hsum(a0[m]) * s0;
      Y[m * N + n + 1] = hsum(a1[m]) * s1;
    }
  }
  for (; n < n1; ++n) {
    vec a0[G];
#pragma GCC unroll 16
    for (int m = 0; m < G; ++m) a0[m] = vzero();
    for (int64_t k = 0; k < K; k += 2 * LANES) {
      vec v0, w0;
      load2(f, n, k, v0, w0);
#pragma GCC unroll 16
      for (int m = 0; m < G; ++m) a0[m] = vfma(v0, vload(X + m * K + k), a0[m]);
#pragma GCC unroll 16
      for (int m = 0; m < G; ++m) a0[m] = vfma(w0, vload(X + m * K + k + LANES), a0[m]);
    }
    const float s0 = f.factor(n);
    for (int m = 0; m < G; ++m) Y[m * N + n] = hsum(a0[m]) * s0;
  }
}

template <class F, int G>
static void dispatch(int g, const F& f, const float* X, float* Y, int64_t K, int64_t N, int64_t n0,
                     int64_t n1) {
  if (g == G) return rows_q<F, G>(f, X, Y, K, N, n0, n1);
  if constexpr (G > 1) dispatch<F, G - 1>(g, f, X, Y, K, N, n0, n1);
}

template <class F>
static void run_q(const F& f, const float* X, float* Y, int64_t M, int64_t K, int64_t N) {
  const int64_t BLK = 32;
  const int64_t g_max = std::max<int64_t>(1, std::min<int64_t>(GROUP, X_IN_L1 / K));
  at::parallel_for(0, (N + 2 * BLK - 1) / (2 * BLK), 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * 2 * BLK, n1 = std::min(N, n0 + 2 * BLK);
      for (int64_t m0 = 0; m0 < M; m0 += g_max) {
        const int g = (int)std::min<int64_t>(g_max, M - m0);
        dispatch<F, GROUP>(g, f, X + m0 * K, Y + m0 * N, K, N, n0, n1);
      }
    }
  });
}

static torch::Tensor prepare(torch::Tensor& x, int64_t K, int64_t N) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == K, "x: float32 [M, K]");
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32");
  x = x.contiguous();
  return torch::empty({x.size(0), N}, x.options());
}

// w8a8: int8 weights (per-channel scale sw, column sums cs) against activations quantised per row
// to int8 (scale sx = absmax / 127, round to nearest even), dot products in int32 (exact: the
// order does not matter), y = (acc - 128 * cs[n]) * (sx[m] * sw[n]). With AVX512-VNNI the
// activations are offset to unsigned (xq + 128) for vpdpbusd, 64 multiply-adds per instruction;
// the AVX2 build computes the same integers with vpmaddwd, so every build gives bitwise the same y.
static void quantize_rows(const float* X, int64_t M, int64_t K, uint8_t* XU, float* SX) {
  for (int64_t m = 0; m < M; ++m) {
    const float* x = X + m * K;
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
    const float s = amax > 0.f ? amax / 127.f : 1.f;
    SX[m] = s;
    for (int64_t k = 0; k < K; ++k) {
      int q = (int)std::nearbyint(x[k] / s);
      q = std::min(127, std::max(-127, q));
      XU[m * K + k] = (uint8_t)(q + 128);
    }
  }
}

#if defined(__AVX512VNNI__)
template <int G>
static void rows_w8a8(const uint8_t* XU, const int8_t* W, int32_t* ACC, int64_t K, int64_t N,
                      int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 1 < n1; n += 2) {
    const int8_t* w0 = W + n * K;
    const int8_t* w1 = w0 + K;
    __m512i a0[G], a1[G];
#pragma GCC unroll 16
    for (int m = 0; m < G; ++m) { a0[m] = _mm512_setzero_si512(); a1[m] = _mm512_setzero_si512(); }
    for (int64_t k = 0; k < K; k += 64) {
      __m512i v0 = _mm512_loadu_si512(w0 + k), v1 = _mm512_loadu_si512(w1 + k);
      prefetch(w0 + k);
      prefetch(w1 + k);
#pragma GCC unroll 16
      for (int m = 0; m < G; ++m) {
        __m512i x = _mm512_loadu_si512(XU + m * K + k);
        a0[m] = _mm512_dpbusd_epi32(a0[m], x, v0);
        a1[m] = _mm512_dpbusd_epi32(a1[m], x, v1);
      }
    }
#pragma GCC unroll 16
    for (int m = 0; m < G; ++m) {
      ACC[m * N + n] = _mm512_reduce_add_epi32(a0[m]);
      ACC[m * N + n + 1] = _mm512_reduce_add_epi32(a1[m]);
    }
  }
  for (; n < n1; ++n) {
    const int8_t* w0 = W + n * K;
    for (int m = 0; m < G; ++m) {
      __m512i a = _mm512_setzero_si512();
      for (int64_t k = 0; k < K; k += 64)
        a = _mm512_dpbusd_epi32(a, _mm512_loadu_si512(XU + m * K + k), _mm512_loadu_si512(w0 + k));
      ACC[m * N + n] = _mm512_reduce_add_epi32(a);
    }
  }
}

template <int G>
static void dispatch_w8a8(int g, const uint8_t* XU, const int8_t* W, int32_t* ACC, int64_t K,
                          int64_t N, int64_t n0, int64_t n1) {
  if (g == G) return rows_w8a8<G>(XU, W, ACC, K, N, n0, n1);
  if constexpr (G > 1) dispatch_w8a8<G - 1>(g, XU, W, ACC, K, N, n0, n1);
}
#endif

torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor sw, torch::Tensor cs) {
  TORCH_CHECK(w.dtype() == torch::kInt8 && w.is_contiguous(), "w: contiguous int8 [N, K]");
  const int64_t N = w.size(0), K = w.size(1), M = x.size(0);
  TORCH_CHECK(K % 64 == 0, "w8a8: K must be a multiple of 64");
  TORCH_CHECK(sw.dtype() == torch::kFloat32 && sw.is_contiguous() && sw.numel() == N, "sw: float32 [N]");
  TORCH_CHECK(cs.dtype() == torch::kInt32 && cs.is_contiguous() && cs.numel() == N, "cs: int32 [N]");
  auto y = prepare(x, K, N);
  std::vector<uint8_t> xu(M * K);
  std::vector<float> sx(M);
  std::vector<int32_t> acc(M * N);
  quantize_rows(x.data_ptr<float>(), M, K, xu.data(), sx.data());
  const int8_t* W = w.data_ptr<int8_t>();
#if defined(__AVX512VNNI__)
  const int64_t BLK = 32;
  const int64_t g_max = std::max<int64_t>(1, std::min<int64_t>(GROUP, 4 * X_IN_L1 / K));
  at::parallel_for(0, (N + 2 * BLK - 1) / (2 * BLK), 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * 2 * BLK, n1 = std::min(N, n0 + 2 * BLK);
      for (int64_t m0 = 0; m0 < M; m0 += g_max) {
        const int g = (int)std::min<int64_t>(g_max, M - m0);
        dispatch_w8a8<GROUP>(g, xu.data() + m0 * K, W, acc.data() + m0 * N, K, N, n0, n1);
      }
    }
  });
#else
  // AVX2: u8 and s8 widened to 16 bits, vpmaddwd sums pairs of products into 32 bits (exact:
  // |255 * 127 * 2| < 2^31), the same integers as vpdpbusd.
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* w = W + n * K;
      for (int64_t m = 0; m < M; ++m) {
        const uint8_t* x = xu.data() + m * K;
        __m256i a = _mm256_setzero_si256();
        for (int64_t k = 0; k < K; k += 16) {
          __m256i x16 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(x + k)));
          __m256i w16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + k)));
          a = _mm256_add_epi32(a, _mm256_madd_epi16(x16, w16));
        }
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
        s = _mm_hadd_epi32(s, s);
        s = _mm_hadd_epi32(s, s);
        acc[m * N + n] = _mm_cvtsi128_si32(s);
      }
    }
  });
#endif
  const float* SW = sw.data_ptr<float>();
  const int32_t* CS = cs.data_ptr<int32_t>();
  float* Y = y.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n)
      Y[m * N + n] = (float)(acc[m * N + n] - 128 * CS[n]) * (sx[m] * SW[n]);
  return y;
}

torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(w.dtype() == torch::kBFloat16 && w.is_contiguous(), "w: contiguous bfloat16 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  auto y = prepare(x, K, N);
  BF16 f{reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), K};
  run_q(f, x.data_ptr<float>(), y.data_ptr<float>(), x.size(0), K, N);
  return y;
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor s) {
  TORCH_CHECK(w.dtype() == torch::kInt8 && w.is_contiguous(), "w: contiguous int8 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(s.dtype() == torch::kFloat32 && s.is_contiguous() && s.numel() == N, "s: float32 [N]");
  auto y = prepare(x, K, N);
  I8 f{w.data_ptr<int8_t>(), s.data_ptr<float>(), K};
  run_q(f, x.data_ptr<float>(), y.data_ptr<float>(), x.size(0), K, N);
  return y;
}

torch::Tensor q8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor d) {
  TORCH_CHECK(w.dtype() == torch::kInt8 && w.is_contiguous(), "w: contiguous int8 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(d.dtype() == torch::kFloat32 && d.is_contiguous() && d.numel() == N * (K / 32),
              "d: float32 [N, K/32]");
  auto y = prepare(x, K, N);
  Q8 f{w.data_ptr<int8_t>(), d.data_ptr<float>(), K};
  run_q(f, x.data_ptr<float>(), y.data_ptr<float>(), x.size(0), K, N);
  return y;
}

torch::Tensor q4_linear(torch::Tensor x, torch::Tensor w, torch::Tensor d, torch::Tensor m) {
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.is_contiguous(), "w: contiguous uint8 [N, K/2]");
  const int64_t N = w.size(0), K = 2 * w.size(1);
  TORCH_CHECK(d.dtype() == torch::kFloat32 && d.is_contiguous() && d.numel() == N * (K / 32) &&
              m.dtype() == torch::kFloat32 && m.is_contiguous() && m.numel() == N * (K / 32),
              "d, m: float32 [N, K/32]");
  auto y = prepare(x, K, N);
  Q4 f{w.data_ptr<uint8_t>(), d.data_ptr<float>(), m.data_ptr<float>(), K};
  run_q(f, x.data_ptr<float>(), y.data_ptr<float>(), x.size(0), K, N);
  return y;
}
