// The row-by-row parts of d3d::layer (layer.cpp): norms, rotary embedding, attention, SiLU. Every sum is
// taken in a fixed order that does not depend on the other rows of the call or on the vector path, so a
// row's result is bitwise the same in a decoding step, a verification pass or a token tree, on any CPU.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vec.h"

namespace d3d::rows {


constexpr int64_t LANES = 16;  // partial sums of dot(): added pairwise at the end

#ifdef D3D_VEC
using d3d::Vec;
constexpr int64_t LANE_REGS = LANES / Vec::W;  // registers that hold dot()'s 16 lane sums

// The 16 lane sums added pairwise, in lane_sum's order: l + (l + 8), then + 4, + 2, + 1.
inline float reduce16(const Vec::T* acc) {
#if defined(D3D_AVX512)
  const __m512 v = acc[0];
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
#elif defined(D3D_AVX2)
  const __m256 a = _mm256_add_ps(acc[0], acc[1]);
#endif
#if defined(D3D_AVX512) || defined(D3D_AVX2)
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
#else
  float l[LANES];
  for (int64_t r = 0; r < LANE_REGS; ++r) Vec::store(l + r * Vec::W, acc[r]);
  for (int64_t w = LANES / 2; w > 0; w /= 2)
    for (int64_t i = 0; i < w; ++i) l[i] += l[i + w];
  return l[0];
#endif
}
#endif

// sum_i term(i) in 16 lane sums (term i goes to lane i % 16) reduced pairwise: a fixed order, so the
// same in every call, which the compiler can vectorize without reassociating anything.
template <typename Term>
inline float lane_sum(int64_t n, Term term) {
  float acc[LANES] = {0.f};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int64_t l = 0; l < LANES; ++l) acc[l] += term(i + l);
  for (int64_t l = 0; i < n; ++i, ++l) acc[l] += term(i);
  for (int64_t w = LANES / 2; w > 0; w /= 2)
    for (int64_t l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

// sum_i a[i] * b[i] by lane_sum (the vector path computes exactly what lane_sum does).
inline float dot(const float* a, const float* b, int64_t n) {
#ifdef D3D_VEC
  if (n % LANES == 0) {
    Vec::T acc[LANE_REGS];
    for (int64_t r = 0; r < LANE_REGS; ++r) acc[r] = Vec::zero();
    for (int64_t i = 0; i < n; i += LANES)
      for (int64_t r = 0; r < LANE_REGS; ++r)
        acc[r] = Vec::add(acc[r], Vec::mul(Vec::load(a + i + r * Vec::W), Vec::load(b + i + r * Vec::W)));
    return reduce16(acc);
  }
#endif
  return lane_sum(n, [&](int64_t i) { return a[i] * b[i]; });
}

inline float sum(const float* a, int64_t n) {
  return lane_sum(n, [&](int64_t i) { return a[i]; });
}

// e^x for x in [-87, 88] (clamped there, so results stay normal floats), to about 2 ulp: 2^k * p(r) with
// k = round(x / ln 2) and a degree-6 polynomial on r = x - k ln 2. Plain arithmetic, no libm call, so a
// loop over it vectorizes and every element gets the same result in any position.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float k = (x * 1.44269504f + 12582912.f) - 12582912.f;  // round to nearest (|k| < 2^22)
  const float r = (x - k * 0.693359375f) + k * 2.12194440e-4f;  // ln 2 in two parts
  float p = 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (int32_t(k) + 127) * (1 << 23);  // 2^k
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

#ifdef D3D_VEC
// exp_approx on every lane: the same operations in the same order (the clamps as std::max(x, lo) = lo > x ? lo :
// x and std::min(x, hi) = hi < x ? hi : x), so the same bits. Written out because compilers vectorize the
// scalar loops over exp_approx on some paths only (not on AVX2: 6.6 us for a 1536-wide SiLU against 0.96 us
// on AVX-512).
inline Vec::T exp_lanes(Vec::T x) {
  x = Vec::min(Vec::set1(88.f), Vec::max(Vec::set1(-87.f), x));
  const Vec::T big = Vec::set1(12582912.f);
  const Vec::T k = Vec::sub(Vec::add(Vec::mul(x, Vec::set1(1.44269504f)), big), big);
  const Vec::T r = Vec::add(Vec::sub(x, Vec::mul(k, Vec::set1(0.693359375f))), Vec::mul(k, Vec::set1(2.12194440e-4f)));
  Vec::T p = Vec::set1(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = Vec::add(Vec::mul(p, r), Vec::set1(c));
  return Vec::mul(p, Vec::pow2i(k));
}
#endif

// scores[t] = exp_approx(scores[t] - peak) for t < n.
inline void exp_shifted(float* scores, int64_t n, float peak) {
  int64_t t = 0;
#ifdef D3D_VEC
  for (; t + Vec::W <= n; t += Vec::W)
    Vec::store(scores + t, exp_lanes(Vec::sub(Vec::load(scores + t), Vec::set1(peak))));
#endif
  for (; t < n; ++t) scores[t] = exp_approx(scores[t] - peak);
}

inline void rms_norm(const float* x, const float* w, int64_t n, float eps, float* out) {
  const float r = 1.f / std::sqrt(dot(x, x, n) / float(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
}

// HF's rotate-half rotary embedding of one head vector v[D] in place.
inline void rope(float* v, const float* cos, const float* sin, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float x1 = v[j], x2 = v[j + half];
    v[j] = x1 * cos[j] - x2 * sin[j];
    v[j + half] = x2 * cos[j] + x1 * sin[j];
  }
}

// out[D] += sum over the visible keys in turn (keys[t], or t itself without a key list) of scores[t] * v[D]:
// per element the same additions in the same order on every path, so that a sum over all the keys at once or
// over consecutive runs of them (attend_rows' chunks) is the same bits. The vector path holds R registers of
// sums at a time (a chunk of R * W elements of out) over all the keys, chunk after chunk.
template <int64_t R>
inline void weighted_sum(const float* scores, const int64_t* keys, int64_t n, const float* vc, int64_t D,
                         float* out) {
#ifdef D3D_VEC
  if constexpr (R > 0) {
    for (int64_t c0 = 0; c0 < D; c0 += R * Vec::W) {
      Vec::T acc[R];
      for (int64_t c = 0; c < R; ++c) acc[c] = Vec::load(out + c0 + c * Vec::W);
      for (int64_t t = 0; t < n; ++t) {
        const float* v = vc + (keys ? keys[t] : t) * D + c0;
        const Vec::T s = Vec::set1(scores[t]);
        for (int64_t c = 0; c < R; ++c) acc[c] = Vec::add(acc[c], Vec::mul(s, Vec::load(v + c * Vec::W)));
      }
      for (int64_t c = 0; c < R; ++c) Vec::store(out + c0 + c * Vec::W, acc[c]);
    }
    return;
  }
#endif
  for (int64_t t = 0; t < n; ++t) {
    const float* v = vc + (keys ? keys[t] : t) * D;
    for (int64_t d = 0; d < D; ++d) out[d] += scores[t] * v[d];
  }
}

// weighted_sum over chunks of 128 elements where 128 / W registers fit beside the rest (AVX-512), else of 64
// (8 of AVX2's 16 registers, 16 of NEON's 32).
inline void weighted_sum_any(const float* scores, const int64_t* keys, int64_t n, const float* vc, int64_t D,
                             float* out) {
#ifdef D3D_VEC
  if constexpr (Vec::W == 16) {
    if (D % 128 == 0) return weighted_sum<128 / Vec::W>(scores, keys, n, vc, D, out);
  }
  if (D % 64 == 0) return weighted_sum<64 / Vec::W>(scores, keys, n, vc, D, out);
#endif
  weighted_sum<0>(scores, keys, n, vc, D, out);
}

// scores[t] = dot(q, key t) * scale for the n keys (keys[t], or t itself without a key list), and their maximum.
// The vector path takes DOT_KEYS keys at a time: each key's sum is dot()'s, but the keys' chains of additions
// are independent, so they overlap instead of each waiting on its own (one key's 64 products are only 4
// dependent additions on AVX-512, then the lane reduction).
inline float scaled_dots(const float* q, const float* kc, const int64_t* keys, int64_t n, int64_t D, float scale,
                         float* scores) {
  float peak = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
#ifdef D3D_VEC
  constexpr int64_t DOT_KEYS = 4;
  if (D % LANES == 0)
    for (; t + DOT_KEYS <= n; t += DOT_KEYS) {
      const float* k[DOT_KEYS];
      Vec::T acc[DOT_KEYS][LANE_REGS];
      for (int64_t b = 0; b < DOT_KEYS; ++b) {
        k[b] = kc + (keys ? keys[t + b] : t + b) * D;
        for (int64_t r = 0; r < LANE_REGS; ++r) acc[b][r] = Vec::zero();
      }
      for (int64_t i = 0; i < D; i += LANES)
        for (int64_t r = 0; r < LANE_REGS; ++r) {
          const Vec::T qv = Vec::load(q + i + r * Vec::W);
          for (int64_t b = 0; b < DOT_KEYS; ++b)
            acc[b][r] = Vec::add(acc[b][r], Vec::mul(qv, Vec::load(k[b] + i + r * Vec::W)));
        }
      for (int64_t b = 0; b < DOT_KEYS; ++b) {
        scores[t + b] = reduce16(acc[b]) * scale;
        peak = std::max(peak, scores[t + b]);
      }
    }
#endif
  for (; t < n; ++t) {
    scores[t] = dot(q, kc + (keys ? keys[t] : t) * D, D) * scale;
    peak = std::max(peak, scores[t]);
  }
  return peak;
}

// Attention of query rows 0..nr-1, heads 0..nh-1 of one KV group (query (j, h) at q + j * q_stride + h * D, its
// result at out + j * out_stride + h * D) over the keys kc and values vc [keys][D] of their sequence: row j sees,
// in cache order, those of its first n_keys[j] that mask_rows[j] marks (nullptr: all of them, causal). Each
// query's result is out[D] = softmax(q.k / sqrt(D)) . v with the sums of attend_row alone, bit for bit; but the
// keys and values are read in chunks of about 16 KB that every query takes in turn while the chunk is in the
// cache. Query by query, a token tree's 16 rows times a group's heads each read the whole cache: at 1,200 tokens
// of context that was two thirds of an 8-row forward of int4 SmolLM2. scratch: one thread's working memory, kept
// from call to call (a forward makes one call per layer and task).
struct AttendScratch {
  std::vector<float> scores, peak, total;
  std::vector<int64_t> keys, n, at;
};

inline void attend_rows(const float* q, int64_t q_stride, int64_t nr, int64_t nh, const bool* const* mask_rows,
                        const int64_t* n_keys, const float* kc, const float* vc, int64_t D, float* out,
                        int64_t out_stride, AttendScratch& scratch) {
  int64_t most = 0;
  for (int64_t j = 0; j < nr; ++j) most = std::max(most, n_keys[j]);
  std::vector<float>& scores = scratch.scores;
  std::vector<float>& peak = scratch.peak;
  std::vector<float>& total = scratch.total;
  std::vector<int64_t>& keys = scratch.keys;
  std::vector<int64_t>& n = scratch.n;
  std::vector<int64_t>& at = scratch.at;
  scores.resize(nr * nh * most);
  keys.resize(nr * most);
  n.resize(nr);
  at.resize(nr);
  total.resize(nr * nh);
  peak.assign(nr * nh, -std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < nr; ++j) {
    n[j] = n_keys[j];
    if (mask_rows[j]) {
      n[j] = 0;
      for (int64_t t = 0; t < n_keys[j]; ++t)
        if (mask_rows[j][t]) keys[j * most + n[j]++] = t;
    }
  }
  const int64_t chunk = std::max<int64_t>(16, 4096 / D);
  // Row j's visible keys in cache positions c0 .. c1 - 1 are entries at[j] .. end of its list (or of 0 .. n[j] - 1).
  const auto each_chunk = [&](auto visit) {
    std::fill(at.begin(), at.end(), 0);
    for (int64_t c0 = 0; c0 < most; c0 += chunk) {
      const int64_t c1 = std::min(most, c0 + chunk);
      for (int64_t j = 0; j < nr; ++j) {
        const int64_t* list = mask_rows[j] ? keys.data() + j * most : nullptr;
        int64_t end = std::min(n[j], c1);
        if (list)
          for (end = at[j]; end < n[j] && list[end] < c1; ++end) {}
        if (end > at[j]) visit(j, list, at[j], end);
        at[j] = end;
      }
    }
  };
  const float scale = 1.f / std::sqrt(float(D));
  each_chunk([&](int64_t j, const int64_t* list, int64_t b, int64_t e) {
    for (int64_t h = 0; h < nh; ++h) {
      float* s = scores.data() + (j * nh + h) * most;
      const float p = list ? scaled_dots(q + j * q_stride + h * D, kc, list + b, e - b, D, scale, s + b)
                           : scaled_dots(q + j * q_stride + h * D, kc + b * D, nullptr, e - b, D, scale, s + b);
      peak[j * nh + h] = std::max(peak[j * nh + h], p);
    }
  });
  for (int64_t j = 0; j < nr; ++j)
    for (int64_t h = 0; h < nh; ++h) {
      float* s = scores.data() + (j * nh + h) * most;
      exp_shifted(s, n[j], peak[j * nh + h]);
      total[j * nh + h] = sum(s, n[j]);
      std::fill(out + j * out_stride + h * D, out + j * out_stride + (h + 1) * D, 0.f);
    }
  each_chunk([&](int64_t j, const int64_t* list, int64_t b, int64_t e) {
    for (int64_t h = 0; h < nh; ++h) {
      const float* s = scores.data() + (j * nh + h) * most + b;
      float* o = out + j * out_stride + h * D;
      if (list) weighted_sum_any(s, list + b, e - b, vc, D, o);
      else weighted_sum_any(s, nullptr, e - b, vc + b * D, D, o);
    }
  });
  for (int64_t j = 0; j < nr; ++j)
    for (int64_t h = 0; h < nh; ++h) {
      const float inv = n[j] ? 1.f / total[j * nh + h] : 0.f;
      for (int64_t d = 0; d < D; ++d) out[j * out_stride + h * D + d] *= inv;
    }
}

// Attention of one query row and head over the keys it may see (attend_rows of one query).
inline void attend_row(const float* q, const float* kc, const float* vc, const bool* mask_row, int64_t n_keys,
                       int64_t D, float* out, AttendScratch& scratch) {
  attend_rows(q, 0, 1, 1, &mask_row, &n_keys, kc, vc, D, out, 0, scratch);
}

// a[j] = SiLU(gate[j]) * up[j] for j < n.
inline void silu_mul(const float* gate, const float* up, int64_t n, float* a) {
  int64_t j = 0;
#ifdef D3D_VEC
  for (; j + Vec::W <= n; j += Vec::W) {
    const Vec::T g = Vec::load(gate + j);
    const Vec::T e = exp_lanes(Vec::neg(g));
    Vec::store(a + j, Vec::mul(Vec::div(g, Vec::add(Vec::set1(1.f), e)), Vec::load(up + j)));
  }
#endif
  for (; j < n; ++j) a[j] = gate[j] / (1.f + exp_approx(-gate[j])) * up[j];
}

}  // namespace d3d::rows
