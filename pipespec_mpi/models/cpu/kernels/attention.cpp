// Causal attention of new query rows over each sequence's cached keys and values, every row
// computed alone: a row's result depends only on its query and the keys and values up to its
// own position, never on how many rows or sequences share the call. So a verification's rows,
// a batched forward's rows and one-token steps give the same bits for the same position (what
// greedy losslessness needs), and B sequences take one call per layer instead of B.
//
// q: [1, H, R, D] (the rows of all sequences, sequence after sequence); ks[b], vs[b]:
// [1, H_kv, L_b, D] (the cache after the new rows were written: the sequence's last n_b
// positions are its new rows), last dimension contiguous. bounds: the B + 1 row offsets. Row i
// of sequence b (position L_b - n_b + i) attends keys 0 .. L_b - n_b + i. Query head h reads
// key/value head h / (H / H_kv). Returns [1, R, H * D].
//
// Per row and head: s_j = (q . k_j) * scale, e_j = exp(s_j - max s), out = sum_j e_j v_j / sum e_j.
// Every sum runs in an order fixed by D and the row's own key count: a dot product over D in
// vectors, then a fixed tree over the lanes (lane_sums; one horizontal sum where D is not a
// whole number of vectors); the softmax sum lane by lane over the keys in vectors (the
// last vector's unused lanes zero), then one horizontal sum; the weighted sum key after key.
#include "simd.h"
#include <cmath>
#include <vector>

#if defined(__AVX512F__)
static inline float hmax(vec v) { return _mm512_reduce_max_ps(v); }
// lanes [0, n) of a, the others zero
static inline vec vfirst(vec a, int n) { return _mm512_maskz_mov_ps((__mmask16)((1u << n) - 1u), a); }
static inline vec vpow2i(vec n) { return _mm512_scalef_ps(vset1(1.0f), n); }
static inline vec vfloor(vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
#else
static inline float hmax(vec v) {
  float t[8];
  _mm256_storeu_ps(t, v);
  float m = t[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, t[i]);
  return m;
}
static inline vec vfirst(vec a, int n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx));
  return _mm256_and_ps(a, keep);
}
static inline vec vpow2i(vec n) {  // 2^n for integral n in [-126, 127]
  __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
static inline vec vfloor(vec a) { return _mm256_floor_ps(a); }
#endif

// exp(x) for x <= 0 (scores less their maximum): 2^n exp(r) with n = floor(x log2(e) + 1/2) and
// r = x - n ln 2 in two parts (Cody-Waite), exp(r) by Cephes' degree-6 polynomial (~1 ulp);
// below -87 the result is 0, as the float32 exp underflows there.
static inline vec vexp(vec x) {
  const vec lo = vset1(-87.0f);
  vec xc = vmax(x, lo);
  vec n = vfloor(vfma(xc, vset1(1.44269504088896341f), vset1(0.5f)));
  vec r = vfma(n, vset1(-0.693359375f), xc);
  r = vfma(n, vset1(2.12194440e-4f), r);
  vec p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  vec r2 = vmul(r, r);
  p = vfma(p, r2, vadd(r, vset1(1.0f)));
  vec y = vmul(p, vpow2i(n));
#if defined(__AVX512F__)
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ), y);
#else
  return _mm256_and_ps(y, _mm256_cmp_ps(x, lo, _CMP_GE_OQ));
#endif
}

static inline float dot(const float* a, const float* b, int64_t d) {
  vec acc = vzero();
  int64_t c = 0;
  for (; c + LANES <= d; c += LANES) acc = vfma(vload(a + c), vload(b + c), acc);
  float s = hsum(acc);
  for (; c < d; ++c) s += a[c] * b[c];
  return s;
}

// The lane sums of LANES vectors a[0..LANES) as one vector (lane j: a[j]'s sum), by a fixed tree
// per vector: lanes (0+2)+(1+3) within each 128-bit block, then the blocks pairwise; no vector's
// sum depends on the others.
static inline vec lane_sums(vec* a) {
#if defined(__AVX512F__)
  vec u[8], w[4], x[2];
  for (int i = 0; i < 8; ++i)
    u[i] = vadd(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(u[2 * i]), _mm512_castps_pd(u[2 * i + 1]));
    __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(u[2 * i]), _mm512_castps_pd(u[2 * i + 1]));
    w[i] = vadd(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));  // block k: vectors 4i..4i+3, block k's sum
  }
  for (int i = 0; i < 2; ++i)
    x[i] = vadd(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x44), _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xEE));
  return vadd(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
#else
  vec u[4], w[2];
  for (int i = 0; i < 4; ++i)
    u[i] = vadd(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 2; ++i) {
    __m256d lo = _mm256_unpacklo_pd(_mm256_castps_pd(u[2 * i]), _mm256_castps_pd(u[2 * i + 1]));
    __m256d hi = _mm256_unpackhi_pd(_mm256_castps_pd(u[2 * i]), _mm256_castps_pd(u[2 * i + 1]));
    w[i] = vadd(_mm256_castpd_ps(lo), _mm256_castpd_ps(hi));
  }
  return vadd(_mm256_permute2f128_ps(w[0], w[1], 0x20), _mm256_permute2f128_ps(w[0], w[1], 0x31));
#endif
}

// s[j] = (q . k_j) * scale for j < keys. With D a whole number of vectors, LANES keys at a time
// (a key past the end reads key 0 and is not stored, so a key's score never depends on its
// neighbours); otherwise key by key.
static void scores(const float* qr, const float* K, int64_t keys, int64_t D, float scale, float* s) {
  if (D % LANES) {
    for (int64_t j = 0; j < keys; ++j) s[j] = dot(qr, K + j * D, D) * scale;
    return;
  }
  const vec vs = vset1(scale);
  vec acc[LANES];
  for (int64_t j0 = 0; j0 < keys; j0 += LANES) {
    for (int l = 0; l < LANES; ++l) acc[l] = vzero();
    for (int64_t c = 0; c < D; c += LANES) {
      const vec qc = vload(qr + c);
      for (int l = 0; l < LANES; ++l) {
        const int64_t j = j0 + l < keys ? j0 + l : 0;
        acc[l] = vfma(qc, vload(K + j * D + c), acc[l]);
      }
    }
    const vec r = vmul(lane_sums(acc), vs);
    if (j0 + LANES <= keys) {
      vstore(s + j0, r);
    } else {
      float t[LANES];
      vstore(t, r);
      for (int64_t j = j0; j < keys; ++j) s[j] = t[j - j0];
    }
  }
}

// One row of one head: `keys` positions of K and V (row stride D), query qr, output o [D];
// s: scratch of at least keys rounded up to LANES floats.
static void one_row(const float* qr, const float* K, const float* V, int64_t keys, int64_t D, float scale,
                    float* s, float* o) {
  scores(qr, K, keys, D, scale, s);
  const int64_t full = keys / LANES * LANES;
  const int tail = (int)(keys - full);
  vec m = vset1(-INFINITY);
  for (int64_t j = 0; j < full; j += LANES) m = vmax(m, vload(s + j));
  float mx = hmax(m);
  for (int64_t j = full; j < keys; ++j) mx = std::max(mx, s[j]);
  const vec vm = vset1(mx);
  vec sum = vzero();
  for (int64_t j = 0; j < full; j += LANES) {
    vec e = vexp(vsub(vload(s + j), vm));
    vstore(s + j, e);
    sum = vadd(sum, e);
  }
  if (tail) {  // s has room for a whole vector; the lanes past the keys are dropped
    vec e = vfirst(vexp(vsub(vload(s + full), vm)), tail);
    vstore(s + full, e);
    sum = vadd(sum, e);
  }
  const float inv = 1.0f / hsum(sum);
  int64_t c = 0;
  for (; c + 4 * LANES <= D; c += 4 * LANES) {  // four vectors of the output in registers
    vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
    for (int64_t j = 0; j < keys; ++j) {
      const float* v = V + j * D + c;
      const vec e = vset1(s[j]);
      a0 = vfma(e, vload(v), a0);
      a1 = vfma(e, vload(v + LANES), a1);
      a2 = vfma(e, vload(v + 2 * LANES), a2);
      a3 = vfma(e, vload(v + 3 * LANES), a3);
    }
    const vec vi = vset1(inv);
    vstore(o + c, vmul(a0, vi));
    vstore(o + c + LANES, vmul(a1, vi));
    vstore(o + c + 2 * LANES, vmul(a2, vi));
    vstore(o + c + 3 * LANES, vmul(a3, vi));
  }
  for (; c + LANES <= D; c += LANES) {
    vec a0 = vzero();
    for (int64_t j = 0; j < keys; ++j) a0 = vfma(vset1(s[j]), vload(V + j * D + c), a0);
    vstore(o + c, vmul(a0, vset1(inv)));
  }
  for (; c < D; ++c) {
    float a0 = 0.0f;
    for (int64_t j = 0; j < keys; ++j) a0 += s[j] * V[j * D + c];
    o[c] = a0 * inv;
  }
}

torch::Tensor rows_attention(torch::Tensor q, std::vector<torch::Tensor> ks, std::vector<torch::Tensor> vs,
                             std::vector<int64_t> bounds, double scale) {
  TORCH_CHECK(q.dim() == 4 && q.size(0) == 1 && q.scalar_type() == torch::kFloat32 && q.stride(3) == 1,
              "rows_attention: q must be float32 [1, H, R, D], last dim contiguous");
  const int64_t B = (int64_t)ks.size(), H = q.size(1), R = q.size(2), D = q.size(3);
  TORCH_CHECK((int64_t)vs.size() == B && (int64_t)bounds.size() == B + 1 && bounds[0] == 0 && bounds[B] == R,
              "rows_attention: one key and value tensor per sequence, B + 1 row bounds from 0 to R");
  int64_t hkv = -1, most = 0;
  for (int64_t b = 0; b < B; ++b) {
    const auto& k = ks[b];
    const auto& v = vs[b];
    TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == 1 && k.size(3) == D &&
                    k.scalar_type() == torch::kFloat32 && v.scalar_type() == torch::kFloat32 &&
                    k.stride(3) == 1 && v.stride(3) == 1 && k.stride(2) == D && v.stride(2) == D,
                "rows_attention: keys and values float32 [1, H_kv, L, D], positions contiguous");
    TORCH_CHECK(hkv < 0 || k.size(1) == hkv, "rows_attention: one H_kv for all sequences");
    hkv = k.size(1);
    const int64_t n = bounds[b + 1] - bounds[b];
    TORCH_CHECK(n >= 1 && n <= k.size(2), "rows_attention: a sequence's new rows must be in its cache");
    most = std::max(most, k.size(2));
  }
  TORCH_CHECK(hkv > 0 && H % hkv == 0, "rows_attention: query heads must be a multiple of key heads");
  const int64_t group = H / hkv;
  auto out = torch::empty({1, R, H * D}, q.options());
  const float* Q = q.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const int64_t qh = q.stride(1), qr = q.stride(2);
  const float sc = (float)scale;
  // one task per (sequence, query head); each writes only its own rows' slice of the output
  at::parallel_for(0, B * H, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> s((size_t)((most + LANES - 1) / LANES * LANES));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / H, h = t % H, g = h / group;
      const auto& k = ks[b];
      const auto& v = vs[b];
      const float* K = k.data_ptr<float>() + g * k.stride(1);
      const float* V = v.data_ptr<float>() + g * v.stride(1);
      const int64_t L = k.size(2), n = bounds[b + 1] - bounds[b];
      for (int64_t i = 0; i < n; ++i) {
        const int64_t r = bounds[b] + i;
        one_row(Q + h * qh + r * qr, K, V, L - n + i + 1, D, sc, s.data(), O + r * H * D + h * D);
      }
    }
  });
  return out;
}
