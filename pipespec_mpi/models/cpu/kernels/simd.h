// The SIMD vocabulary of the kernels (flat_linear.cpp, lowbit.cpp, attention.cpp): one vector
// type, its load and store, arithmetic, fused multiply-add and horizontal sum, for AVX-512 or
// AVX2. build() (flat_linear.py) inlines it where a kernel says #include "simd.h", so torch's
// build cache keys on the whole source.
#pragma once
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
static inline vec vset1(float a) { return _mm512_set1_ps(a); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline void vstore(float* p, vec a) { _mm512_storeu_ps(p, a); }
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
static inline vec vset1(float a) { return _mm256_set1_ps(a); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline void vstore(float* p, vec a) { _mm256_storeu_ps(p, a); }
static inline float hsum(vec v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 sh = _mm_movehdup_ps(lo);
  __m128 s = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, s);
  return _mm_cvtss_f32(_mm_add_ss(s, sh));
}
#endif

