// d3d::q4_linear (`--quantize int4`): y = x @ w.T with 4-bit (or 6- or 8-bit) weights in GGUF Q4_K's layout of
// scales, and activations quantized in blocks of 256 as llama.cpp's Q8_K does.
//
// Weights. Along k, each output row is cut into super-blocks of 256 (zero-padded), each into 8 groups of 32;
// a weight is w = d * sc * q - dmin * m, with q in 0..15 (nibbles; `bits` 4), 0..63 (`bits` 6) or 0..254 (bytes;
// `bits` 8), sc and m in 0..63 per group, d and dmin fp32 per super-block. That is exactly Q4_K (whose tensors
// load bit for bit, d3d.runtime.gguf_load); 6 bits over the same scales hold Q6_K / Q5_0 tensors closely (a Q4_K_M
// file's Q6_K tensors are 28% of its weights: in 8 bits they made d3d read 15% more bytes a token than llama.cpp),
// 8 bits Q8_0. Packed per 16 outputs (pack_q4): the groups that hold any k < K one after the other
// (no padding groups: a one-row product streams the weights, and a gap in the stream defeated the hardware
// prefetcher: 576 inputs took twice the time of 768), each, 4 bits: the nibbles of steps 2p (low) and 2p + 1
// (high) of 4 k each, [4 pairs][16 outputs][4 k] bytes; 6 bits: the same nibbles of q's low 4 bits, then q's top 2
// bits in [2 planes][16 outputs][4 k] bytes, plane h holding step 4h + i in bits 2i, 2i + 1; 8 bits: [8 steps][16
// outputs][4 k] bytes; per super-block sc [8][16] and m [8][16] (u8) in a tensor of their own, d [16] and dmin [16]
// (fp32) in a third.
//
// Activations. Each row is quantized per super-block (int8::quantize_row on its 256 values: symmetric int8
// with one scale), and each group's sum of q is kept for the m term.
//
// Sums. Per group, isum = sum q_x * q_w in integers (exact in any order); per super-block A = sum_g sc * isum
// and B = sum_g m * sum(q_x) (integers, no overflow: |A| < 8 * 63 * 32 * 254 * 127); then, in this order on
// every path, acc += x_scale * (d * float(A) - dmin * float(B)). A row's result depends on its own row only
// and is the same bits on every path (built with -ffp-contract=off).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "int8_kernel.h"

#if defined(D3D_SCALAR)
#elif defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define D3D_Q4_PATH 1  // vpdpbusd on 512-bit registers: u8 weights x s8 activations summed in fours, 16 outputs per op
#elif defined(__AVXVNNI__)
#define D3D_Q4_PATH 4  // AVX-VNNI: path 1's vpdpbusd on 256-bit registers, each 16 outputs in two halves
#elif defined(__AVX2__)
#define D3D_Q4_PATH 2  // vpmaddubsw: u8 nibbles x s8 activations, pairs summed in int16 over a group, then int32
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define D3D_Q4_PATH 3  // sdot: nibbles x s8 activations summed in fours, 4 outputs per op
#endif

namespace d3d::q4 {

constexpr int64_t LANES = 16, SUPER = 256, GROUP = 32, GROUPS = SUPER / GROUP;
constexpr int64_t GROUP_BYTES = GROUP * LANES / 2;    // weight bytes per 16 outputs and group at 4 bits (x bits / 4)
constexpr int64_t NIBBLES = GROUP_BYTES;              // where a 6-bit group's plane of top bits starts
constexpr int64_t SCALES = 2 * GROUPS * LANES;        // sc and m bytes per 16 outputs and super-block
constexpr int64_t FACTORS = 2 * LANES;                // d and dmin per 16 outputs and super-block
constexpr int64_t MBLOCK = 4;
constexpr int64_t ROWS = 16;  // rows per pass at most where 4-bit products take more than MBLOCK rows (AVX2)
constexpr int64_t WIDE = 8;   // rows per pass at most with vpdpbusd (two accumulators a row, 32 registers)
// group_add8 sums (q - 127) * x, and its caller adds 127 * sc * sum(x) back, except with vpdpbusd, whose unsigned
// operand takes q (0..254) as it is. Either way A is the same integer.
#if D3D_Q4_PATH == 1 || D3D_Q4_PATH == 4
constexpr bool Q8_CENTRED = false;
#else
constexpr bool Q8_CENTRED = true;
#endif

inline const char* q4_path() {
#if D3D_Q4_PATH == 1
  return "avx512-vnni";
#elif D3D_Q4_PATH == 4
  return "avx-vnni";
#elif D3D_Q4_PATH == 2
  return "avx2";
#elif D3D_Q4_PATH == 3
  return "neon-dotprod";
#else
  return "scalar";
#endif
}

// Row `row` [K] quantized per super-block into q [SB * 256] (s8, padding 0), scales xs [SB] and group sums
// xsum [SB * 8].
inline void quantize_row(const float* row, int64_t K, int8_t* q, float* xs, int32_t* xsum) {
  const int64_t SB = (K + SUPER - 1) / SUPER;
  uint8_t u[SUPER];
  for (int64_t sb = 0; sb < SB; ++sb) {
    const int64_t len = std::min(SUPER, K - sb * SUPER);
    xs[sb] = int8::quantize_row(row + sb * SUPER, nullptr, len, SUPER, u);
    for (int64_t g = 0; g < GROUPS; ++g) {
      int32_t s = 0;
      for (int64_t k = g * GROUP; k < (g + 1) * GROUP; ++k) {
        q[sb * SUPER + k] = int8_t(int32_t(u[k]) - 128);
        s += q[sb * SUPER + k];
      }
      xsum[sb * GROUPS + g] = s;
    }
  }
}

#if D3D_Q4_PATH == 3
// A[i][l] += sc[l] * acc[i][l / 4][l % 4]: a group's int32 sums (four registers of 4 outputs per row)
// scaled by their outputs' scales.
template <int64_t mb>
inline void add_scaled(const int32x4_t (*acc)[4], const uint8_t* sc, int32_t A[mb][LANES]) {
  const uint8x16_t s8 = vld1q_u8(sc);
  const uint16x8_t s16[2] = {vmovl_u8(vget_low_u8(s8)), vmovl_u8(vget_high_u8(s8))};
  for (int64_t j = 0; j < 4; ++j) {
    const int32x4_t s =
        vreinterpretq_s32_u32(j % 2 ? vmovl_high_u16(s16[j / 2]) : vmovl_u16(vget_low_u16(s16[j / 2])));
    for (int64_t i = 0; i < mb; ++i) vst1q_s32(A[i] + j * 4, vmlaq_s32(vld1q_s32(A[i] + j * 4), acc[i][j], s));
  }
}
#endif

#if D3D_Q4_PATH == 1
// Pair p of a group's nibbles (64 bytes: 16 outputs x 4 k, both steps) as bytes: step 2p in `even`, 2p + 1 in `odd`.
inline void nibbles(const uint8_t* w, int64_t p, __m512i& even, __m512i& odd) {
  const __m512i r = _mm512_loadu_si512(w + p * 64), low = _mm512_set1_epi8(0x0F);
  even = _mm512_and_si512(r, low);
  odd = _mm512_and_si512(_mm512_srli_epi16(r, 4), low);
}

// The same pair of a 6-bit group: the nibbles with the steps' top two bits put above them (bits 4, 5).
inline void sixes(const uint8_t* w, int64_t p, __m512i& even, __m512i& odd) {
  nibbles(w, p, even, odd);
  const __m512i h = _mm512_srli_epi16(_mm512_loadu_si512(w + NIBBLES + p / 2 * 64), 4 * (p % 2));
  const __m512i top = _mm512_set1_epi8(0x30);
  even = _mm512_or_si512(even, _mm512_and_si512(_mm512_slli_epi16(h, 4), top));
  odd = _mm512_or_si512(odd, _mm512_and_si512(_mm512_slli_epi16(h, 2), top));
}

// A[i] += s * (acc[i] + odd[i]) for rows i < mb (s: the group's 16 scales as int32).
template <int64_t mb>
inline void add_scaled(const __m512i* acc, const __m512i* odd, __m512i s, int32_t A[mb][LANES]) {
  for (int64_t i = 0; i < mb; ++i) {
    const __m512i sum = _mm512_mullo_epi32(_mm512_add_epi32(acc[i], odd[i]), s);
    _mm512_storeu_si512(A[i], _mm512_add_epi32(_mm512_loadu_si512(A[i]), sum));
  }
}

inline __m512i scales32(const uint8_t* sc) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
}
#endif

#if D3D_Q4_PATH == 2 || D3D_Q4_PATH == 4
// Half h (outputs 8h .. 8h + 7) of pair p of a group's steps as bytes, step 2p in `even`, 2p + 1 in `odd` (6 bits:
// the top two bits put above the nibbles, as path 1's sixes).
template <int64_t bits>
inline void half_pair(const uint8_t* w, int64_t p, int64_t h, __m256i& even, __m256i& odd) {
  const __m256i r = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 64 + h * 32));
  const __m256i low = _mm256_set1_epi8(0x0F);
  even = _mm256_and_si256(r, low);
  odd = _mm256_and_si256(_mm256_srli_epi16(r, 4), low);
  if constexpr (bits == 6) {
    const __m256i t = _mm256_srli_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + NIBBLES + p / 2 * 64 + h * 32)), 4 * (p % 2));
    const __m256i top = _mm256_set1_epi8(0x30);
    even = _mm256_or_si256(even, _mm256_and_si256(_mm256_slli_epi16(t, 4), top));
    odd = _mm256_or_si256(odd, _mm256_and_si256(_mm256_slli_epi16(t, 2), top));
  }
}
#endif

#if D3D_Q4_PATH == 4
// Pair p of a group's steps for rows i < mb: acc[i][h] += even[h] . x's 4 k of step 2p, odd[i][h] (or acc with
// `split` false) += odd[h] . x's 4 k of step 2p + 1.
template <int64_t mb, bool split>
inline void pair_dots(const int8_t* x, int64_t stride, int64_t p, const __m256i* even, const __m256i* odd_w,
                      __m256i (*acc)[2], __m256i (*odd)[2]) {
  for (int64_t i = 0; i < mb; ++i) {
    const __m256i a = _mm256_set1_epi32(int8::quad(x + i * stride + p * 8));
    const __m256i b = _mm256_set1_epi32(int8::quad(x + i * stride + p * 8 + 4));
    for (int64_t h = 0; h < 2; ++h) {
      acc[i][h] = _mm256_dpbusd_avx_epi32(acc[i][h], even[h], a);
      if constexpr (split) odd[i][h] = _mm256_dpbusd_avx_epi32(odd[i][h], odd_w[h], b);
      else acc[i][h] = _mm256_dpbusd_avx_epi32(acc[i][h], odd_w[h], b);
    }
  }
}

// A[i][8h .. 8h + 7] += s[h] * (acc[i][h] + odd[i][h]) for rows i < mb (s: the group's scales as int32, by half).
template <int64_t mb, bool split>
inline void add_scaled(const __m256i (*acc)[2], const __m256i (*odd)[2], const uint8_t* sc, int32_t A[mb][LANES]) {
  for (int64_t h = 0; h < 2; ++h) {
    const __m256i s = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8 * h)));
    for (int64_t i = 0; i < mb; ++i) {
      const __m256i sum = split ? _mm256_add_epi32(acc[i][h], odd[i][h]) : acc[i][h];
      __m256i* out = reinterpret_cast<__m256i*>(A[i]) + h;
      _mm256_storeu_si256(out, _mm256_add_epi32(_mm256_loadu_si256(out), _mm256_mullo_epi32(sum, s)));
    }
  }
}
#endif

#if D3D_Q4_PATH == 2
// A group's nibbles (4 pairs of steps, 256 bytes) as bytes: wv[p] = step 2p outputs 0-7, 8-15, step 2p + 1 the same.
inline void unpack_group(const uint8_t* w, __m256i (*wv)[4]) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t p = 0; p < 4; ++p) {
    const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 64));
    const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 64 + 32));
    wv[p][0] = _mm256_and_si256(r0, low);
    wv[p][1] = _mm256_and_si256(r1, low);
    wv[p][2] = _mm256_and_si256(_mm256_srli_epi16(r0, 4), low);
    wv[p][3] = _mm256_and_si256(_mm256_srli_epi16(r1, 4), low);
  }
}
#endif

// A[i][l] += sc[l] * (sum over the group's 32 k of x[i * stride + k] * q(output l, k)), for rows i < mb; w: the
// group's 4 pairs of steps of nibbles (256 bytes; 6 bits: then the plane of top bits); sc: the group's 16 scales.
template <int64_t bits, int64_t mb>
inline void group_add(const int8_t* x, int64_t stride, const uint8_t* w, const uint8_t* sc, int32_t A[mb][LANES]) {
#if D3D_Q4_PATH == 1
  // each row sums its even and odd steps in two chains, so that one row does not wait on vpdpbusd's latency
  __m512i acc[mb], odd[mb];
  for (int64_t i = 0; i < mb; ++i) acc[i] = odd[i] = _mm512_setzero_si512();
  for (int64_t p = 0; p < 4; ++p) {
    __m512i e, o;
    if constexpr (bits == 6) sixes(w, p, e, o);
    else nibbles(w, p, e, o);
    for (int64_t i = 0; i < mb; ++i) {
      acc[i] = _mm512_dpbusd_epi32(acc[i], e, _mm512_set1_epi32(int8::quad(x + i * stride + p * 8)));
      odd[i] = _mm512_dpbusd_epi32(odd[i], o, _mm512_set1_epi32(int8::quad(x + i * stride + p * 8 + 4)));
    }
  }
  add_scaled<mb>(acc, odd, scales32(sc), A);
#elif D3D_Q4_PATH == 4
  // 16 registers: one or two rows sum even and odd steps in chains of their own (a row's two halves alone would
  // wait on vpdpbusd's latency); from three rows on the rows' chains are enough, and four chains a row would spill
  constexpr bool split = mb <= 2;
  __m256i acc[mb][2], odd[mb][2];
  for (int64_t i = 0; i < mb; ++i) acc[i][0] = acc[i][1] = odd[i][0] = odd[i][1] = _mm256_setzero_si256();
  for (int64_t p = 0; p < 4; ++p) {
    __m256i e[2], o[2];
    for (int64_t h = 0; h < 2; ++h) half_pair<bits>(w, p, h, e[h], o[h]);
    pair_dots<mb, split>(x, stride, p, e, o, acc, odd);
  }
  add_scaled<mb, split>(acc, odd, sc, A);
#elif D3D_Q4_PATH == 2
  if constexpr (bits == 6) {
    // a pair's two vpmaddubsw sum at most 4 * 63 * 127 = 32004 in int16, and no more: vpmaddwd scales each pair's
    // sums into int32 (as group_add8 does each step)
    const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));
    const __m256i s[2] = {_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(s8, s8)), _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(s8, s8))};
    __m256i acc[mb][2];
    for (int64_t i = 0; i < mb; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
    for (int64_t p = 0; p < 4; ++p) {
      __m256i e[2], o[2];
      for (int64_t h = 0; h < 2; ++h) half_pair<6>(w, p, h, e[h], o[h]);  // outputs 0-7, 8-15
      for (int64_t i = 0; i < mb; ++i) {
        const __m256i a = _mm256_set1_epi32(int8::quad(x + i * stride + p * 8));
        const __m256i b = _mm256_set1_epi32(int8::quad(x + i * stride + p * 8 + 4));
        for (int64_t h = 0; h < 2; ++h)
          acc[i][h] = _mm256_add_epi32(acc[i][h], _mm256_madd_epi16(
              _mm256_add_epi16(_mm256_maddubs_epi16(e[h], a), _mm256_maddubs_epi16(o[h], b)), s[h]));
      }
    }
    for (int64_t i = 0; i < mb; ++i)
      for (int64_t h = 0; h < 2; ++h) {
        __m256i* out = reinterpret_cast<__m256i*>(A[i]) + h;
        _mm256_storeu_si256(out, _mm256_add_epi32(_mm256_loadu_si256(out), acc[i][h]));
      }
    return;
  }
  // int16 sums stay exact: 8 steps of two products of at most 15 * 127 each, 30480 in all; vpmaddwd then
  // multiplies each output's two int16 sums by its scale and adds them in int32. The group's nibbles are
  // unpacked once into `wv` (L1), then each row runs on its own accumulators: with all rows' accumulators and
  // the unpacked weights live at once the compiler spilled registers inside the loop.
  alignas(32) __m256i wv[4][4];
  unpack_group(w, wv);
  const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));  // each scale twice, as int16
  const __m256i s0 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(s8, s8)), s1 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(s8, s8));
  for (int64_t i = 0; i < mb; ++i) {
    __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
    for (int64_t p = 0; p < 4; ++p) {
      const __m256i a = _mm256_set1_epi32(int8::quad(x + i * stride + p * 8));
      const __m256i b = _mm256_set1_epi32(int8::quad(x + i * stride + p * 8 + 4));
      acc0 = _mm256_add_epi16(acc0, _mm256_add_epi16(_mm256_maddubs_epi16(wv[p][0], a), _mm256_maddubs_epi16(wv[p][2], b)));
      acc1 = _mm256_add_epi16(acc1, _mm256_add_epi16(_mm256_maddubs_epi16(wv[p][1], a), _mm256_maddubs_epi16(wv[p][3], b)));
    }
    __m256i* out = reinterpret_cast<__m256i*>(A[i]);
    _mm256_storeu_si256(out, _mm256_add_epi32(_mm256_loadu_si256(out), _mm256_madd_epi16(acc0, s0)));
    _mm256_storeu_si256(out + 1, _mm256_add_epi32(_mm256_loadu_si256(out + 1), _mm256_madd_epi16(acc1, s1)));
  }
#elif D3D_Q4_PATH == 3
  const uint8x16_t low = vdupq_n_u8(0x0F);
  int32x4_t acc[mb][4];
  for (int64_t i = 0; i < mb; ++i)
    for (int64_t j = 0; j < 4; ++j) acc[i][j] = vdupq_n_s32(0);
  for (int64_t p = 0; p < 4; ++p) {
    int8x16_t e[4], o[4];
    for (int64_t j = 0; j < 4; ++j) {
      const uint8x16_t r = vld1q_u8(w + p * 64 + j * 16);
      uint8x16_t even = vandq_u8(r, low), odd = vshrq_n_u8(r, 4);
      if constexpr (bits == 6) {  // the steps' top two bits above the nibbles: values 0..63, still signed bytes
        const uint8x16_t t0 = vld1q_u8(w + NIBBLES + p / 2 * 64 + j * 16), t = p % 2 ? vshrq_n_u8(t0, 4) : t0;
        even = vorrq_u8(even, vandq_u8(vshlq_n_u8(t, 4), vdupq_n_u8(0x30)));
        odd = vorrq_u8(odd, vandq_u8(vshlq_n_u8(t, 2), vdupq_n_u8(0x30)));
      }
      e[j] = vreinterpretq_s8_u8(even);
      o[j] = vreinterpretq_s8_u8(odd);
    }
    for (int64_t i = 0; i < mb; ++i) {
      const int8x16_t a = vreinterpretq_s8_s32(vdupq_n_s32(int8::quad(x + i * stride + p * 8)));
      const int8x16_t b = vreinterpretq_s8_s32(vdupq_n_s32(int8::quad(x + i * stride + p * 8 + 4)));
      for (int64_t j = 0; j < 4; ++j) acc[i][j] = vdotq_s32(vdotq_s32(acc[i][j], e[j], a), o[j], b);
    }
  }
  add_scaled<mb>(acc, sc, A);
#else
  for (int64_t i = 0; i < mb; ++i)
    for (int64_t l = 0; l < LANES; ++l) {
      int32_t s = 0;
      for (int64_t p = 0; p < 4; ++p)
        for (int64_t j = 0; j < 4; ++j) {
          const uint8_t byte = w[p * 64 + l * 4 + j];
          // 6 bits: steps 2p and 2p + 1's top bits, in the plane of steps 4 (p / 2) .. 4 (p / 2) + 3
          const int32_t t = bits == 6 ? w[NIBBLES + p / 2 * 64 + l * 4 + j] >> (4 * (p % 2)) : 0;
          s += int32_t(x[i * stride + p * 8 + j]) * ((byte & 0x0F) | (t & 3) << 4) +
               int32_t(x[i * stride + p * 8 + 4 + j]) * ((byte >> 4) | (t >> 2 & 3) << 4);
        }
      A[i][l] += int32_t(sc[l]) * s;
    }
#endif
}

// The same for 8-bit weights: A[i][l] += sc[l] * sum over the group's 32 k of x[i * stride + k] * (q(l, k) - 127),
// w: the group's 8 steps of 4 k, [8][16 outputs][4 k] bytes of q (0..254); the caller adds 127 * sc * sum(x)
// (Q8_CENTRED; with vpdpbusd the sum is of q * x, with no 127 to add back).
template <int64_t mb>
inline void group_add8(const int8_t* x, int64_t stride, const uint8_t* w, const uint8_t* sc, int32_t A[mb][LANES]) {
#if D3D_Q4_PATH == 1
  __m512i acc[mb], odd[mb];
  for (int64_t i = 0; i < mb; ++i) acc[i] = odd[i] = _mm512_setzero_si512();
  for (int64_t step = 0; step < 8; step += 2) {
    const __m512i w0 = _mm512_loadu_si512(w + step * 64), w1 = _mm512_loadu_si512(w + step * 64 + 64);
    for (int64_t i = 0; i < mb; ++i) {
      acc[i] = _mm512_dpbusd_epi32(acc[i], w0, _mm512_set1_epi32(int8::quad(x + i * stride + step * 4)));
      odd[i] = _mm512_dpbusd_epi32(odd[i], w1, _mm512_set1_epi32(int8::quad(x + i * stride + step * 4 + 4)));
    }
  }
  add_scaled<mb>(acc, odd, scales32(sc), A);
#elif D3D_Q4_PATH == 4
  constexpr bool split = mb <= 2;
  __m256i acc[mb][2], odd[mb][2];
  for (int64_t i = 0; i < mb; ++i) acc[i][0] = acc[i][1] = odd[i][0] = odd[i][1] = _mm256_setzero_si256();
  for (int64_t p = 0; p < 4; ++p) {  // steps 2p and 2p + 1: 64 bytes each
    __m256i e[2], o[2];
    for (int64_t h = 0; h < 2; ++h) {
      e[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 128 + h * 32));
      o[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 128 + 64 + h * 32));
    }
    pair_dots<mb, split>(x, stride, p, e, o, acc, odd);
  }
  add_scaled<mb, split>(acc, odd, sc, A);
#elif D3D_Q4_PATH == 2
  // |q - 127| <= 127, so vpmaddubsw on |x| and (q - 127) * sign(x) sums two products exactly in int16 (as the
  // int8 kernel does); vpmaddwd multiplies each output's two sums by its scale into int32 every step
  const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));
  const __m256i s0 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(s8, s8)), s1 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(s8, s8));
  const __m256i centre = _mm256_set1_epi8(127);
  __m256i acc[mb][2];
  for (int64_t i = 0; i < mb; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
  for (int64_t step = 0; step < 8; ++step) {
    const __m256i w0 = _mm256_sub_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + step * 64)), centre);
    const __m256i w1 = _mm256_sub_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + step * 64 + 32)), centre);
    for (int64_t i = 0; i < mb; ++i) {
      const __m256i a = _mm256_set1_epi32(int8::quad(x + i * stride + step * 4)), mag = _mm256_abs_epi8(a);
      acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, _mm256_sign_epi8(w0, a)), s0));
      acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, _mm256_sign_epi8(w1, a)), s1));
    }
  }
  for (int64_t i = 0; i < mb; ++i) {
    __m256i* out = reinterpret_cast<__m256i*>(A[i]);
    _mm256_storeu_si256(out, _mm256_add_epi32(_mm256_loadu_si256(out), acc[i][0]));
    _mm256_storeu_si256(out + 1, _mm256_add_epi32(_mm256_loadu_si256(out + 1), acc[i][1]));
  }
#elif D3D_Q4_PATH == 3
  const int8x16_t centre = vdupq_n_s8(127);
  int32x4_t acc[mb][4];
  for (int64_t i = 0; i < mb; ++i)
    for (int64_t j = 0; j < 4; ++j) acc[i][j] = vdupq_n_s32(0);
  for (int64_t step = 0; step < 8; ++step) {
    int8x16_t q[4];
    for (int64_t j = 0; j < 4; ++j) q[j] = vsubq_s8(vreinterpretq_s8_u8(vld1q_u8(w + step * 64 + j * 16)), centre);
    for (int64_t i = 0; i < mb; ++i) {
      const int8x16_t a = vreinterpretq_s8_s32(vdupq_n_s32(int8::quad(x + i * stride + step * 4)));
      for (int64_t j = 0; j < 4; ++j) acc[i][j] = vdotq_s32(acc[i][j], q[j], a);
    }
  }
  add_scaled<mb>(acc, sc, A);
#else
  for (int64_t i = 0; i < mb; ++i)
    for (int64_t l = 0; l < LANES; ++l) {
      int32_t s = 0;
      for (int64_t step = 0; step < 8; ++step)
        for (int64_t j = 0; j < 4; ++j)
          s += int32_t(x[i * stride + step * 4 + j]) * (int32_t(w[step * 64 + l * 4 + j]) - 127);
      A[i][l] += int32_t(sc[l]) * s;
    }
#endif
}

// out[l] = sum_g v[g][l] * gs[g] (v: a super-block's sc or m [8][16] u8; gs: a row's group sums of q).
inline void group_weighted(const uint8_t* v, const int32_t* gs, int32_t* out) {
#if D3D_Q4_PATH == 1 || D3D_Q4_PATH == 2 || D3D_Q4_PATH == 4
  __m256i B[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int64_t g = 0; g < GROUPS; g += 2) {  // vpmaddwd over two groups: v[g][l] * gs[g] + v[g + 1][l] * gs[g + 1]
    const __m128i mg = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v + g * LANES));
    const __m128i mh = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v + (g + 1) * LANES));
    const __m256i pair = _mm256_set1_epi32(int32_t(uint32_t(uint16_t(gs[g])) | (uint32_t(uint16_t(gs[g + 1])) << 16)));
    B[0] = _mm256_add_epi32(B[0], _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mg, mh)), pair));
    B[1] = _mm256_add_epi32(B[1], _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_unpackhi_epi8(mg, mh)), pair));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), B[0]);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8), B[1]);
#else
  for (int64_t l = 0; l < LANES; ++l) out[l] = 0;
  for (int64_t g = 0; g < GROUPS; ++g)
    for (int64_t l = 0; l < LANES; ++l) out[l] += int32_t(v[g * LANES + l]) * gs[g];
#endif
}

// One row's super-block done: B[l] = sum_g m[g][l] * gs[g] and acc[l] += s * (d[l] * float(A[l]) - dmin[l] * float(B[l])).
inline void super_block_end(const int32_t* gs, float s, const uint8_t* m, const float* d, const float* dmin,
                            const int32_t* A, float* acc) {
  alignas(32) int32_t B[LANES];
  group_weighted(m, gs, B);
#if D3D_Q4_PATH == 1 || D3D_Q4_PATH == 2 || D3D_Q4_PATH == 4
  const __m256 sv = _mm256_set1_ps(s);
  for (int64_t h = 0; h < 2; ++h) {
    const __m256 a = _mm256_mul_ps(_mm256_loadu_ps(d + 8 * h),
                                   _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(A + 8 * h))));
    const __m256 b = _mm256_mul_ps(_mm256_loadu_ps(dmin + 8 * h),
                                   _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(B + 8 * h))));
    _mm256_storeu_ps(acc + 8 * h, _mm256_add_ps(_mm256_loadu_ps(acc + 8 * h), _mm256_mul_ps(sv, _mm256_sub_ps(a, b))));
  }
#else
  for (int64_t l = 0; l < LANES; ++l) {
    const float t = d[l] * float(A[l]) - dmin[l] * float(B[l]);
    acc[l] = acc[l] + s * t;
  }
#endif
}

#if D3D_Q4_PATH == 2
// Products of more than MBLOCK rows at 4 bits (a tree, a batch, a prompt chunk): each group's nibbles are unpacked
// once for up to ROWS rows, then each half of the 16 outputs runs through the rows four at a time with its two
// weight registers held: n + 4 registers live, none spilled. At 16 rows 0.76-0.83x the time of the per-row path on
// the pair's shapes (standalone, AMD EPYC, 2 threads). The sums are integers: the bits are every other path's.
template <int64_t n>
inline void rows_add(const int8_t* x, int64_t stride, const __m256i (*wv)[4], __m256i s0, __m256i s1, int32_t (*A)[LANES]) {
  for (int64_t h = 0; h < 2; ++h) {
    __asm__ volatile("" ::: "memory");  // the halves load their broadcasts anew: kept live across them, they spilled
    __m256i acc[n];
    for (int64_t i = 0; i < n; ++i) acc[i] = _mm256_setzero_si256();
    for (int64_t p = 0; p < 4; ++p) {
      const __m256i even = _mm256_load_si256(&wv[p][h]), odd = _mm256_load_si256(&wv[p][2 + h]);
      for (int64_t i = 0; i < n; ++i) {
        acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(even, _mm256_set1_epi32(int8::quad(x + i * stride + p * 8))));
        acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(odd, _mm256_set1_epi32(int8::quad(x + i * stride + p * 8 + 4))));
        // a chain: integer sums may be reassociated, and GCC made them a tree whose products were all live at
        // once, spilled to the stack
        __asm__("" : "+x"(acc[i]));
      }
    }
    const __m256i s = h ? s1 : s0;
    for (int64_t i = 0; i < n; ++i) {
      __m256i* out = reinterpret_cast<__m256i*>(A[i]) + h;
      _mm256_storeu_si256(out, _mm256_add_epi32(_mm256_loadu_si256(out), _mm256_madd_epi16(acc[i], s)));
    }
  }
}

// A[i][l] += sc[l] * (the group's sum for row i and output l), rows i < mb (at most ROWS).
inline void group_add_rows(const int8_t* x, int64_t stride, int64_t mb, const uint8_t* w, const uint8_t* sc,
                           int32_t (*A)[LANES]) {
  alignas(32) __m256i wv[4][4];
  unpack_group(w, wv);
  const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));
  const __m256i s0 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(s8, s8)), s1 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(s8, s8));
  int64_t i = 0;
  for (; i + 4 <= mb; i += 4) rows_add<4>(x + i * stride, stride, wv, s0, s1, A + i);
  switch (mb - i) {
    case 3: rows_add<3>(x + i * stride, stride, wv, s0, s1, A + i); break;
    case 2: rows_add<2>(x + i * stride, stride, wv, s0, s1, A + i); break;
    case 1: rows_add<1>(x + i * stride, stride, wv, s0, s1, A + i); break;
  }
}

#endif

// Outputs n0 = 16 * nb .. n0 + 15 (those below N) of rows m0 .. m0 + rows - 1 (see the top of this file): rows
// is mb, or with mb = ROWS (4-bit, AVX2: group_add_rows) any count up to ROWS; with vpdpbusd mb runs to WIDE.
// Groups past k = K (padding: zero activations) are not stored. A pass of more than MBLOCK rows (the first of
// its block) prefetches the next block's weights: a 16-row forward of the int4 pair took 115 ms against 131-134 ms
// without (AVX-512 EPYC, 2 threads); one-row passes are left to the hardware prefetcher, which streams them.
template <int64_t bits, int64_t mb>
inline void block_out(int64_t rows, const int8_t* xq, int64_t K, const float* xs, const int32_t* xsum,
                      const uint8_t* wq, const uint8_t* wsm, const float* wdd, int64_t nb, int64_t N, int64_t m0,
                      const float* bias, float* y) {
  const int64_t SB = (K + SUPER - 1) / SUPER, Kp = SB * SUPER, G = (K + GROUP - 1) / GROUP, last = G - (SB - 1) * GROUPS;
  const int64_t n0 = nb * LANES, nl = std::min(LANES, N - n0), n = mb == ROWS ? rows : mb;
  constexpr int64_t gb = bits * GROUP_BYTES / 4;  // a group's weight bytes
  float acc[mb][LANES] = {};
  for (int64_t sb = 0; sb < SB; ++sb) {
    const uint8_t* q = wq + (nb * G + sb * GROUPS) * gb;
    const uint8_t* sc = wsm + (nb * SB + sb) * SCALES;
    const uint8_t* m = sc + GROUPS * LANES;
    const float* d = wdd + (nb * SB + sb) * FACTORS;
    const float* dmin = d + LANES;
    alignas(32) int32_t A[mb][LANES] = {};
    for (int64_t g = 0; g < (sb + 1 < SB ? GROUPS : last); ++g) {
      const int8_t* x = xq + m0 * Kp + sb * SUPER + g * GROUP;
      if (mb > MBLOCK && m0 == 0)  // the next block's group, on the way from memory while this one's rows run
        for (int64_t line = 0; line < gb / 64; ++line) __builtin_prefetch(q + G * gb + g * gb + line * 64, 0, 3);
#if D3D_Q4_PATH == 2
      if constexpr (bits == 4 && mb == ROWS) group_add_rows(x, Kp, n, q + g * gb, sc + g * LANES, A);
      else
#endif
      if constexpr (bits == 8) group_add8<mb>(x, Kp, q + g * gb, sc + g * LANES, A);
      else group_add<bits, mb>(x, Kp, q + g * gb, sc + g * LANES, A);
    }
    if constexpr (bits == 8 && Q8_CENTRED)  // the 127 that group_add8 took out of every q: 127 * sum_g sc * sum(x)
      for (int64_t i = 0; i < n; ++i) {
        alignas(32) int32_t C[LANES];
        group_weighted(sc, xsum + (m0 + i) * SB * GROUPS + sb * GROUPS, C);
        for (int64_t l = 0; l < LANES; ++l) A[i][l] += 127 * C[l];
      }
    for (int64_t i = 0; i < n; ++i)
      super_block_end(xsum + (m0 + i) * SB * GROUPS + sb * GROUPS, xs[(m0 + i) * SB + sb], m, d, dmin, A[i], acc[i]);
  }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t l = 0; l < nl; ++l) y[(m0 + i) * N + n0 + l] = bias ? acc[i][l] + bias[n0 + l] : acc[i][l];
}

template <int64_t bits, typename... Args>
inline void rows_out(int64_t mb, Args... args) {
  switch (mb) {
    case 1: return block_out<bits, 1>(mb, args...);
    case 2: return block_out<bits, 2>(mb, args...);
    case 3: return block_out<bits, 3>(mb, args...);
    case 4: return block_out<bits, 4>(mb, args...);
#if D3D_Q4_PATH == 1
    case 5: return block_out<bits, 5>(mb, args...);
    case 6: return block_out<bits, 6>(mb, args...);
    case 7: return block_out<bits, 7>(mb, args...);
    default: return block_out<bits, WIDE>(mb, args...);
#elif D3D_Q4_PATH == 2
    default: return block_out<bits, ROWS>(mb, args...);  // 4-bit only (blocks)
#else
    default: return block_out<bits, MBLOCK>(mb, args...);  // not reached: blocks takes MBLOCK rows at most
#endif
  }
}

// Blocks b0 .. b1 - 1 (16 outputs each) of y [M, N] for the quantized rows of K inputs: one thread's share.
inline void blocks(int64_t bits, const int8_t* xq, int64_t M, int64_t K, const float* xs, const int32_t* xsum,
                   const uint8_t* wq, const uint8_t* wsm, const float* wdd, int64_t N, const float* bias, float* y,
                   int64_t b0, int64_t b1) {
#if D3D_Q4_PATH == 1
  const int64_t step = WIDE;
#elif D3D_Q4_PATH == 2
  const int64_t step = bits == 4 && M > MBLOCK ? ROWS : MBLOCK;
#else
  const int64_t step = MBLOCK;
#endif
  for (int64_t nb = b0; nb < b1; ++nb)
    for (int64_t m0 = 0; m0 < M; m0 += step) {
      const int64_t mb = std::min(step, M - m0);
      if (bits == 8) rows_out<8>(mb, xq, K, xs, xsum, wq, wsm, wdd, nb, N, m0, bias, y);
      else if (bits == 6) rows_out<6>(mb, xq, K, xs, xsum, wq, wsm, wdd, nb, N, m0, bias, y);
      else rows_out<4>(mb, xq, K, xs, xsum, wq, wsm, wdd, nb, N, m0, bias, y);
    }
}

}  // namespace d3d::q4
