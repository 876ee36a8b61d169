// d3d::fp32_linear: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) in fp32, with every sum taken over k in
// order by fused multiply-adds from zero: a row's result does not depend on the other rows of the call, so
// a one-token step and a row of a 16-token verification give bitwise the same numbers (oneDNN's kernels
// change the order with the number of rows). Weights come packed [N/64][K][64] (d3d.kernels.pack_fp32): a
// tile of up to MBLOCK rows x 64 outputs reads each weight vector once for all its rows, and a one-row call
// streams the weights once, which is what decoding is bound by.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace d3d::fp32 {

constexpr int64_t GROUP = 64;  // outputs per packed group
#if defined(D3D_AVX2)
constexpr int64_t MBLOCK = 6;  // rows per tile at most: 6 rows x 16 outputs keep 12 FMA chains in 16 registers
#else
constexpr int64_t MBLOCK = 4;
#endif

#ifdef D3D_VEC
using d3d::Vec;

// Registers of outputs per sub-tile for `mb` rows: the mb * nv sums, and for several rows the nv weight
// vectors they share, must fit the register file (32 on AVX-512 and NEON, 16 on AVX2); one row takes the
// whole group (its weight loads fold into the FMAs).
template <int64_t mb>
constexpr int64_t sub_vectors() {
  constexpr int64_t regs = Vec::W == 8 ? 16 : 32;
  int64_t nv = GROUP / Vec::W;
  while (nv > 1 && mb * nv + (mb > 1 ? nv : 0) > regs - 2) nv /= 2;
  return nv;
}
#endif

// Rows m0 .. m0 + mb - 1 times outputs 64 g .. 64 g + 63, over k0 <= k < k1: each output's sum over k in
// order by fused multiply-adds, from zero (k0 = 0) or from the partial sum a previous call left in y, and
// + bias once k1 = K. The rows come as a k-major panel (xk[k * mb + i]: each broadcast one address off one
// pointer, where six row pointers would not fit AVX2's registers beside the sums). The vector paths cover the
// 64 outputs in sub-tiles of nv registers. pf: the next chunk of weights (the next KCHUNK k steps of this
// group, or the next group's first: the packed weights are one stream), a line of it prefetched each k step
// (4 / subs lines where the sub-tiles are fewer) into L2, so that it comes from memory while this chunk
// computes. On the AVX2 EPYC this and the panels made 4 to 32-row products 12-30% faster than a prefetch of
// the next whole group (which for K = 1536 is 393 KB: more than L1 and L2 can hold beside the current one).
template <int64_t mb, bool prefetch>
inline void tile(const float* xk, int64_t K, const float* w, int64_t g, int64_t N, int64_t m0, const float* bias,
                 float* y, int64_t k0, int64_t k1, const char* pf) {
  const float* wg = w + g * K * GROUP;
  const bool last = k1 == K;
#ifdef D3D_VEC
  constexpr int64_t nv = sub_vectors<mb>(), width = nv * Vec::W, subs = GROUP / width;
  constexpr int64_t per_step = subs >= 4 ? 1 : 4 / subs;
  for (int64_t s = 0; s < subs; ++s) {
    const int64_t o = s * width;
    Vec::T acc[mb][nv];
    for (int64_t i = 0; i < mb; ++i)
      for (int64_t j = 0; j < nv; ++j)
        acc[i][j] = k0 ? Vec::load(y + (m0 + i) * N + g * GROUP + o + j * Vec::W) : Vec::zero();
    const char* pfs = pf + s * (k1 - k0) * per_step * 64;
    for (int64_t k = k0; k < k1; ++k) {
      if constexpr (prefetch)
        for (int64_t p = 0; p < per_step; ++p) __builtin_prefetch(pfs + ((k - k0) * per_step + p) * 64, 0, 2);
      Vec::T wv[nv];
      for (int64_t j = 0; j < nv; ++j) wv[j] = Vec::load(wg + k * GROUP + o + j * Vec::W);
      for (int64_t i = 0; i < mb; ++i) {
        const Vec::T a = Vec::set1(xk[k * mb + i]);
        for (int64_t j = 0; j < nv; ++j) acc[i][j] = Vec::fma(a, wv[j], acc[i][j]);
      }
    }
    for (int64_t i = 0; i < mb; ++i)
      for (int64_t j = 0; j < nv; ++j) {
        Vec::T v = acc[i][j];
        if (bias && last) v = Vec::add(v, Vec::load(bias + g * GROUP + o + j * Vec::W));
        Vec::store(y + (m0 + i) * N + g * GROUP + o + j * Vec::W, v);
      }
  }
#else
  for (int64_t i = 0; i < mb; ++i)
    for (int64_t l = 0; l < GROUP; ++l) {
      float* out = y + (m0 + i) * N + g * GROUP + l;
      float s = k0 ? *out : 0.f;
      for (int64_t k = k0; k < k1; ++k) s = std::fma(xk[k * mb + i], wg[k * GROUP + l], s);
      *out = bias && last ? s + bias[g * GROUP + l] : s;
    }
#endif
}

// tile<mb> for a row count known only at run time (1 .. MBLOCK).
template <bool prefetch, int64_t mb = MBLOCK, typename... Args>
inline void tile_rows(int64_t rows, Args... args) {
  if constexpr (mb > 1)
    if (rows < mb) return tile_rows<prefetch, mb - 1>(rows, args...);
  tile<mb, prefetch>(args...);
}

// One row times outputs 64 g + o .. 64 g + o + 31 (half a group), over all k: for each output the sum that
// tile<1> takes (from zero, by fused multiply-adds over k in order, + bias). Decoding splits a layer with an
// odd number of groups between two threads at a half group (halves below) instead of leaving one thread a
// whole group more: SmolLM2's 576-wide products have 9 groups, 5 against 4.
inline void half_tile(const float* x, int64_t K, const float* w, int64_t g, int64_t o, const float* bias, float* y) {
  constexpr int64_t HALF = GROUP / 2;
  const float* wg = w + g * K * GROUP + o;
  float* out = y + g * GROUP + o;
#ifdef D3D_VEC
  constexpr int64_t nv = HALF / Vec::W;
  Vec::T acc[nv];
  for (int64_t j = 0; j < nv; ++j) acc[j] = Vec::zero();
  for (int64_t k = 0; k < K; ++k) {
    const Vec::T a = Vec::set1(x[k]);
    for (int64_t j = 0; j < nv; ++j) acc[j] = Vec::fma(a, Vec::load(wg + k * GROUP + j * Vec::W), acc[j]);
  }
  for (int64_t j = 0; j < nv; ++j)
    Vec::store(out + j * Vec::W, bias ? Vec::add(acc[j], Vec::load(bias + g * GROUP + o + j * Vec::W)) : acc[j]);
#else
  for (int64_t l = 0; l < HALF; ++l) {
    float s = 0.f;
    for (int64_t k = 0; k < K; ++k) s = std::fma(x[k], wg[k * GROUP + l], s);
    out[l] = bias ? s + bias[g * GROUP + o + l] : s;
  }
#endif
}

// k steps per pass over a group when several rows share it: the row blocks and the sub-tiles of a chunk
// (KCHUNK x 64 weights, 16 KB) read it from L1 after the first has brought it in.
constexpr int64_t KCHUNK = 64;

// The rows of x [M, K] as k-major panels of up to MBLOCK rows (tile's xk), one after the other.
inline void pack_panels(const float* xp, int64_t M, int64_t K, float* panels) {
  for (int64_t m0 = 0; m0 < M; m0 += MBLOCK) {
    const int64_t mb = std::min(MBLOCK, M - m0);
    float* p = panels + m0 * K;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t i = 0; i < mb; ++i) p[k * mb + i] = xp[(m0 + i) * K + k];
  }
}

// Groups g0 .. g1 - 1 (64 outputs each) of y [M, 64 G] = x [M, K] times the packed weights (+ bias): one
// thread's share. One row (a decoding step) streams each group once, whole k, and leaves the prefetching to
// the hardware. Several rows go chunk by chunk, each chunk through every row block, the first row block
// prefetching the next chunk: the weights are read from memory once, and while one chunk computes.
inline void groups(const float* xp, int64_t M, int64_t K, const float* wp, int64_t G, const float* bp, float* yp,
                   int64_t g0, int64_t g1) {
  const int64_t N = G * GROUP;
  if (M == 1) {
    for (int64_t g = g0; g < g1; ++g) tile<1, false>(xp, K, wp, g, N, 0, bp, yp, 0, K, nullptr);
    return;
  }
  thread_local std::vector<float> panels;
  panels.resize(M * K);
  pack_panels(xp, M, K, panels.data());
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t k0 = 0; k0 < K; k0 += KCHUNK) {
      const int64_t k1 = std::min(K, k0 + KCHUNK);
      const char* next = reinterpret_cast<const char*>(wp + (g * K + k1) * GROUP);
      const bool fetch = g + 1 < g1 || k1 < K;
      for (int64_t m0 = 0; m0 < M; m0 += MBLOCK) {
        const int64_t mb = std::min(MBLOCK, M - m0);
        const float* xk = panels.data() + m0 * K;
        if (fetch && m0 == 0) tile_rows<true>(mb, xk, K, wp, g, N, m0, bp, yp, k0, k1, next);
        else tile_rows<false>(mb, xk, K, wp, g, N, m0, bp, yp, k0, k1, next);
      }
    }
}

// Half groups h0 .. h1 - 1 (32 outputs each; half group h is outputs 32 h ..) of a one-row product: one
// thread's share, whole groups where the share has them (groups) and a half group at an odd end.
inline void halves(const float* xp, int64_t K, const float* wp, int64_t G, const float* bp, float* yp, int64_t h0,
                   int64_t h1) {
  if (h0 < h1 && h0 % 2) half_tile(xp, K, wp, h0++ / 2, GROUP / 2, bp, yp);
  if (h0 < h1 && h1 % 2) half_tile(xp, K, wp, --h1 / 2, 0, bp, yp);
  if (h0 < h1) groups(xp, 1, K, wp, G, bp, yp, h0 / 2, h1 / 2);
}

}  // namespace d3d::fp32
