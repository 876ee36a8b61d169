// d3d::int8_linear: y[m, n] = (sum_k q[m, k] * w[n, k]) * x_scale[m] * w_scale[n] (+ bias[n]), where
// q[m] is row m of x * smooth quantized to symmetric int8 with its own scale x_scale[m]. Each output row
// depends on its own input row only and the integer sums are exact, so a row's result is bitwise the same
// whatever else is in the batch. Weights come packed for VNNI: [N/16][K/4][16][4] int8 (pack_int8).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"  // the float path (D3D_AVX512, D3D_AVX2, D3D_NEON), which quantize_row's loops take

#if defined(D3D_SCALAR)
#elif defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define D3D_INT8_PATH 1  // vpdpbusd on 512-bit registers: u8 x s8 products summed in fours, 16 outputs per op
#elif defined(__AVXVNNI__)
#include <immintrin.h>
#define D3D_INT8_PATH 4  // AVX-VNNI: vpdpbusd on 256-bit registers (Intel client CPUs from Alder Lake on)
#elif defined(__AVX2__)
#include <immintrin.h>
#define D3D_INT8_PATH 2  // vpmaddubsw on |q| x sign(q) w (pairs fit int16: 2 * 127 * 127), vpmaddwd to int32
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#include <arm_neon.h>
#define D3D_INT8_PATH 3  // sdot: s8 x s8 products summed in fours, 4 outputs per op
#endif


namespace d3d::int8 {

// The int8 products' instructions in this build (several per vector path: VNNI or not, ARM's dot product or not).
inline const char* int8_path() {
#if D3D_INT8_PATH == 1
  return "avx512-vnni";
#elif D3D_INT8_PATH == 2
  return "avx2";
#elif D3D_INT8_PATH == 3
  return "neon-dotprod";
#elif D3D_INT8_PATH == 4
  return "avx-vnni";
#else
  return "scalar";
#endif
}

constexpr int64_t LANES = 16;

// Four bytes at p as one int32 (to broadcast four activations; p need not be aligned).
inline int32_t quad(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
#if D3D_INT8_PATH == 2
constexpr int64_t MBLOCK = 4;  // two int32 sums per row, so 4 rows keep AVX2's 16 registers free of spills
#elif D3D_INT8_PATH == 4
constexpr int64_t MBLOCK = 6;  // two int32 sums per row: 12 accumulators, 2 weight registers, 1 activation
#else
constexpr int64_t MBLOCK = 8;
#endif

// Outputs n0 = 16 * nb .. n0 + 15 (those below N) of rows m0 .. m0 + mb - 1: y = float(sum(q * w)) * x_scale[m]
// * w_scale[n] (+ bias[n]), in that order in every path (built with -ffp-contract=off). The integer sums are
// exact in every path (only their order differs, which integers do not see), so all paths agree bitwise.
template <int64_t mb>
inline void block_out(const uint8_t* xq, const int8_t* qsm, int64_t K4, const int8_t* wb, int64_t nb, int64_t N,
                      int64_t m0, const int32_t* wsum, const float* wsc, const float* xs, const float* bias, float* y) {
  const int64_t n0 = nb * LANES, nl = std::min(LANES, N - n0);
  int32_t sums[mb][LANES];
#if D3D_INT8_PATH == 1
  // mb is a compile-time constant, so the accumulators stay in registers. With one row, even and odd k steps
  // sum apart: a single chain of vpdpbusd would wait on its own latency every step.
  __m512i acc[mb], odd = _mm512_setzero_si512();
  for (int64_t i = 0; i < mb; ++i) acc[i] = _mm512_setzero_si512();
  int64_t kk = 0;
  if constexpr (mb == 1)
    for (; kk + 1 < K4; kk += 2) {
      const uint8_t* x = xq + m0 * K4 * 4 + kk * 4;
      acc[0] = _mm512_dpbusd_epi32(acc[0], _mm512_set1_epi32(quad(x)), _mm512_loadu_si512(wb + kk * 64));
      odd = _mm512_dpbusd_epi32(odd, _mm512_set1_epi32(quad(x + 4)), _mm512_loadu_si512(wb + kk * 64 + 64));
    }
  for (; kk < K4; ++kk) {
    const __m512i w = _mm512_loadu_si512(wb + kk * 64);
    for (int64_t i = 0; i < mb; ++i) {
      int32_t a;
      std::memcpy(&a, xq + (m0 + i) * K4 * 4 + kk * 4, 4);
      acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_set1_epi32(a), w);
    }
  }
  acc[0] = _mm512_add_epi32(acc[0], odd);
  // the u8 activations are q + 128: take 128 * sum(w) back out
  const __mmask16 mask = __mmask16((1u << nl) - 1);
  const __m512i zero_point = _mm512_mullo_epi32(_mm512_set1_epi32(128), _mm512_maskz_loadu_epi32(mask, wsum + n0));
  for (int64_t i = 0; i < mb; ++i) _mm512_storeu_si512(sums[i], _mm512_sub_epi32(acc[i], zero_point));
#elif D3D_INT8_PATH == 2
  __m256i acc[mb][2];
  for (int64_t i = 0; i < mb; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t kk = 0; kk < K4; ++kk) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + kk * 64));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + kk * 64 + 32));
    for (int64_t i = 0; i < mb; ++i) {
      int32_t a, b;  // four q (s8) and their four |q|, broadcast straight from memory
      std::memcpy(&a, qsm + (m0 + i) * K4 * 8 + kk * 4, 4);
      std::memcpy(&b, qsm + (m0 + i) * K4 * 8 + K4 * 4 + kk * 4, 4);
      const __m256i q = _mm256_set1_epi32(a), mag = _mm256_set1_epi32(b);
      const __m256i p0 = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(w0, q));  // q * w, adjacent pairs summed
      const __m256i p1 = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(w1, q));
      acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(p0, ones));  // and pairs of pairs, in int32
      acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(p1, ones));
    }
  }
  for (int64_t i = 0; i < mb; ++i) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums[i]), acc[i][0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums[i] + 8), acc[i][1]);
  }
#elif D3D_INT8_PATH == 4
  __m256i acc[mb][2], odd0 = _mm256_setzero_si256(), odd1 = _mm256_setzero_si256();  // odd: as in path 1
  for (int64_t i = 0; i < mb; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
  int64_t kk = 0;
  if constexpr (mb == 1)
    for (; kk + 1 < K4; kk += 2) {
      const uint8_t* x = xq + m0 * K4 * 4 + kk * 4;
      const __m256i qa = _mm256_set1_epi32(quad(x)), qb = _mm256_set1_epi32(quad(x + 4));
      const __m256i* w = reinterpret_cast<const __m256i*>(wb + kk * 64);
      acc[0][0] = _mm256_dpbusd_avx_epi32(acc[0][0], qa, _mm256_loadu_si256(w));
      acc[0][1] = _mm256_dpbusd_avx_epi32(acc[0][1], qa, _mm256_loadu_si256(w + 1));
      odd0 = _mm256_dpbusd_avx_epi32(odd0, qb, _mm256_loadu_si256(w + 2));
      odd1 = _mm256_dpbusd_avx_epi32(odd1, qb, _mm256_loadu_si256(w + 3));
    }
  for (; kk < K4; ++kk) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + kk * 64));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + kk * 64 + 32));
    for (int64_t i = 0; i < mb; ++i) {
      int32_t a;
      std::memcpy(&a, xq + (m0 + i) * K4 * 4 + kk * 4, 4);
      const __m256i q = _mm256_set1_epi32(a);
      acc[i][0] = _mm256_dpbusd_avx_epi32(acc[i][0], q, w0);
      acc[i][1] = _mm256_dpbusd_avx_epi32(acc[i][1], q, w1);
    }
  }
  acc[0][0] = _mm256_add_epi32(acc[0][0], odd0);
  acc[0][1] = _mm256_add_epi32(acc[0][1], odd1);
  for (int64_t i = 0; i < mb; ++i) {  // the u8 activations are q + 128: take 128 * sum(w) back out
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums[i]), acc[i][0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums[i] + 8), acc[i][1]);
    for (int64_t l = 0; l < nl; ++l) sums[i][l] -= 128 * wsum[n0 + l];
  }
#elif D3D_INT8_PATH == 3
  int32x4_t acc[mb][4];
  for (int64_t i = 0; i < mb; ++i)
    for (int64_t j = 0; j < 4; ++j) acc[i][j] = vdupq_n_s32(0);
  for (int64_t kk = 0; kk < K4; ++kk) {
    int8x16_t w[4];
    for (int64_t j = 0; j < 4; ++j) w[j] = vld1q_s8(wb + kk * 64 + j * 16);
    for (int64_t i = 0; i < mb; ++i) {
      uint32_t a;
      std::memcpy(&a, xq + (m0 + i) * K4 * 4 + kk * 4, 4);
      const int8x16_t q = vreinterpretq_s8_u32(vdupq_n_u32(a ^ 0x80808080u));  // u8 q + 128 -> s8 q
      for (int64_t j = 0; j < 4; ++j) acc[i][j] = vdotq_s32(acc[i][j], w[j], q);
    }
  }
  for (int64_t i = 0; i < mb; ++i)
    for (int64_t j = 0; j < 4; ++j) vst1q_s32(sums[i] + j * 4, acc[i][j]);
#else
  for (int64_t i = 0; i < mb; ++i)
    for (int64_t l = 0; l < nl; ++l) {
      int32_t s = 0;
      for (int64_t kk = 0; kk < K4; ++kk)
        for (int64_t j = 0; j < 4; ++j)
          s += (int32_t(xq[(m0 + i) * K4 * 4 + kk * 4 + j]) - 128) * int32_t(wb[kk * 64 + l * 4 + j]);
      sums[i][l] = s;
    }
#endif
  for (int64_t i = 0; i < mb; ++i)
    for (int64_t l = 0; l < nl; ++l) {
      const float v = float(sums[i][l]) * xs[m0 + i] * wsc[n0 + l];
      y[(m0 + i) * N + n0 + l] = bias ? v + bias[n0 + l] : v;
    }
}

template <typename... Args>
inline void block_rows(int64_t mb, Args... args) {
  switch (mb) {
    case 1: return block_out<1>(args...);
    case 2: return block_out<2>(args...);
    case 3: return block_out<3>(args...);
    case 4: return block_out<4>(args...);
    case 5: return block_out<5>(args...);
    case 6: return block_out<6>(args...);
    case 7: return block_out<7>(args...);
    default: return block_out<8>(args...);
  }
}

// max_k |row[k] (* smooth[k])|: a maximum, so the same in any order; a NaN is passed over, as std::max(peak, v)
// passes it over.
inline float abs_peak(const float* row, const float* smooth, int64_t K) {
  float peak = 0.f;
  int64_t k = 0;
#if defined(D3D_AVX512)
  __m512 acc = _mm512_setzero_ps();
  for (; k + 16 <= K; k += 16) {
    __m512 v = _mm512_loadu_ps(row + k);
    if (smooth) v = _mm512_mul_ps(v, _mm512_loadu_ps(smooth + k));
    acc = _mm512_max_ps(_mm512_abs_ps(v), acc);  // the second operand where the first is NaN
  }
  peak = _mm512_reduce_max_ps(acc);
#elif defined(D3D_AVX2)
  __m256 acc = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (; k + 8 <= K; k += 8) {
    __m256 v = _mm256_loadu_ps(row + k);
    if (smooth) v = _mm256_mul_ps(v, _mm256_loadu_ps(smooth + k));
    acc = _mm256_max_ps(_mm256_andnot_ps(sign, v), acc);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, acc);
  for (float l : lanes) peak = std::max(peak, l);
#elif defined(D3D_NEON)
  float32x4_t acc = vdupq_n_f32(0.f);
  for (; k + 4 <= K; k += 4) {
    float32x4_t v = vld1q_f32(row + k);
    if (smooth) v = vmulq_f32(v, vld1q_f32(smooth + k));
    acc = vmaxnmq_f32(acc, vabsq_f32(v));  // the number where one is NaN
  }
  peak = vmaxvq_f32(acc);
#endif
  for (; k < K; ++k) peak = std::max(peak, std::fabs(smooth ? row[k] * smooth[k] : row[k]));
  return peak;
}

// Row m of x (times smooth) as u8 = round(v * (1 / scale)) + 128, scale = max|v| / 127, over Kp slots
// (padding: 128, i.e. zero). Rounding is nearbyint's: to nearest even in the default mode, which the vector
// conversions use too (MXCSR, FPCR), so every path gives the same bytes.
inline float quantize_row(const float* row, const float* smooth, int64_t K, int64_t Kp, uint8_t* q) {
  const float peak = abs_peak(row, smooth, K);
  const float s = peak > 0.f ? peak / 127.f : 1.f;
  const float inv = 1.f / s;
  int64_t k = 0;
#if defined(D3D_AVX512)
  for (; k + 16 <= K; k += 16) {
    __m512 v = _mm512_loadu_ps(row + k);
    if (smooth) v = _mm512_mul_ps(v, _mm512_loadu_ps(smooth + k));
    const __m512i i = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(inv))), _mm512_set1_epi32(128));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(i));
  }
#elif defined(D3D_AVX2)
  for (; k + 8 <= K; k += 8) {
    __m256 v = _mm256_loadu_ps(row + k);
    if (smooth) v = _mm256_mul_ps(v, _mm256_loadu_ps(smooth + k));
    const __m256i i = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v, _mm256_set1_ps(inv))), _mm256_set1_epi32(128));
    const __m128i u16 = _mm_packus_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));  // 1..255 fit
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm_packus_epi16(u16, u16));
  }
#elif defined(D3D_NEON)
  for (; k + 8 <= K; k += 8) {
    int16x4_t half[2];
    for (int64_t h = 0; h < 2; ++h) {
      float32x4_t v = vld1q_f32(row + k + 4 * h);
      if (smooth) v = vmulq_f32(v, vld1q_f32(smooth + k + 4 * h));
      const float32x4_t r = vrndiq_f32(vmulq_f32(v, vdupq_n_f32(inv)));  // integral: the conversion is exact
      half[h] = vmovn_s32(vaddq_s32(vcvtq_s32_f32(r), vdupq_n_s32(128)));
    }
    vst1_u8(q + k, vqmovun_s16(vcombine_s16(half[0], half[1])));
  }
#endif
  for (; k < K; ++k)
    q[k] = uint8_t(int32_t(std::nearbyint((smooth ? row[k] * smooth[k] : row[k]) * inv)) + 128);
  for (k = K; k < Kp; ++k) q[k] = 128;
  return s;
}

// Blocks b0 .. b1 - 1 (16 outputs each) of y [M, N] for the quantized rows qp [M, 4 K4]: one thread's share.
inline void blocks(const uint8_t* qp, int64_t M, int64_t K4, const int8_t* wp, int64_t N, const int32_t* wsum,
                   const float* wsc, const float* xs, const float* bp, float* yp, int64_t b0, int64_t b1) {
  std::vector<int8_t> qsm;  // path 2: each row's q (s8) then |q|, made once here rather than per 16 outputs
#if D3D_INT8_PATH == 2
  const int64_t Kp = K4 * 4;
  qsm.resize(M * 2 * Kp);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < Kp; ++k) {
      const int32_t q = int32_t(qp[m * Kp + k]) - 128;
      qsm[m * 2 * Kp + k] = int8_t(q);
      qsm[m * 2 * Kp + Kp + k] = int8_t(q < 0 ? -q : q);
    }
#endif
  for (int64_t nb = b0; nb < b1; ++nb)
    for (int64_t m0 = 0; m0 < M; m0 += MBLOCK)
      block_rows(std::min(MBLOCK, M - m0), qp, qsm.data(), K4, wp + nb * K4 * 64, nb, N, m0, wsum, wsc, xs, bp, yp);
}

}  // namespace d3d::int8
