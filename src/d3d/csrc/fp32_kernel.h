// d3d::fp32_linear: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) in fp32, with every sum taken over k in
// order by fused multiply-adds from zero: a row's result does not depend on the other rows of the call, so
// a one-token step and a row of a 16-token verification give bitwise the same numbers (oneDNN's kernels
// change the order with the number of rows). Weights come packed [N/64][K][64] (d3d.kernels.pack_fp32): a
// tile of up to 4 rows x 64 outputs reads each weight vector once for all its rows, and a one-row call
// streams the weights once, which is what decoding is bound by.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "vec.h"

namespace d3d::fp32 {

constexpr int64_t GROUP = 64, MBLOCK = 4;  // outputs per packed group; rows per tile at most

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

// Rows m0 .. m0 + mb - 1 times outputs 64 g .. 64 g + 63: each output's sum over k in order by fused
// multiply-adds from zero, then + bias. The vector paths cover the 64 outputs in sub-tiles of nv registers.
// pf: `lines` cache lines to prefetch while the tile computes (from the next group's weights), spread
// evenly over its k steps.
template <int64_t mb, bool prefetch>
inline void tile(const float* x, int64_t K, const float* w, int64_t g, int64_t N, int64_t m0, const float* bias,
                 float* y, const char* pf, int64_t lines) {
  const float* wg = w + g * K * GROUP;
#ifdef D3D_VEC
  constexpr int64_t nv = sub_vectors<mb>(), width = nv * Vec::W, subs = GROUP / width;
  const int64_t per_k = (lines + subs * K - 1) / (subs * K);
  for (int64_t s = 0; s < subs; ++s) {
    const int64_t o = s * width;
    Vec::T acc[mb][nv];
    for (int64_t i = 0; i < mb; ++i)
      for (int64_t j = 0; j < nv; ++j) acc[i][j] = Vec::zero();
    for (int64_t k = 0; k < K; ++k) {
      if constexpr (prefetch)
        for (int64_t p = (s * K + k) * per_k; p < std::min(lines, (s * K + k + 1) * per_k); ++p)
          __builtin_prefetch(pf + p * 64, 0, 3);
      Vec::T wv[nv];
      for (int64_t j = 0; j < nv; ++j) wv[j] = Vec::load(wg + k * GROUP + o + j * Vec::W);
      for (int64_t i = 0; i < mb; ++i) {
        const Vec::T a = Vec::set1(x[(m0 + i) * K + k]);
        for (int64_t j = 0; j < nv; ++j) acc[i][j] = Vec::fma(a, wv[j], acc[i][j]);
      }
    }
    for (int64_t i = 0; i < mb; ++i)
      for (int64_t j = 0; j < nv; ++j) {
        Vec::T v = acc[i][j];
        if (bias) v = Vec::add(v, Vec::load(bias + g * GROUP + o + j * Vec::W));
        Vec::store(y + (m0 + i) * N + g * GROUP + o + j * Vec::W, v);
      }
  }
#else
  for (int64_t i = 0; i < mb; ++i)
    for (int64_t l = 0; l < GROUP; ++l) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s = std::fma(x[(m0 + i) * K + k], wg[k * GROUP + l], s);
      y[(m0 + i) * N + g * GROUP + l] = bias ? s + bias[g * GROUP + l] : s;
    }
#endif
}

// Groups g0 .. g1 - 1 (64 outputs each) of y [M, 64 G] = x [M, K] times the packed weights (+ bias): one
// thread's share. With several row blocks a group's weights are read once from memory and then again
// from cache; the next group's weights are prefetched meanwhile, spread over all the passes, so that
// memory keeps streaming while the later passes compute (a one-pass call is left to the hardware
// prefetcher).
inline void groups(const float* xp, int64_t M, int64_t K, const float* wp, int64_t G, const float* bp, float* yp,
                   int64_t g0, int64_t g1) {
  const int64_t N = G * GROUP, passes = (M + MBLOCK - 1) / MBLOCK, group_lines = K * GROUP * 4 / 64;
  const int64_t chunk = passes > 1 ? (group_lines + passes - 1) / passes : 0;
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t m0 = 0, pass = 0; m0 < M; m0 += MBLOCK, ++pass) {
      const int64_t first = pass * chunk;
      const int64_t lines = g + 1 < g1 ? std::max<int64_t>(0, std::min(chunk, group_lines - first)) : 0;
      const char* pf = reinterpret_cast<const char*>(wp + (g + 1) * K * GROUP) + first * 64;
      switch (std::min(MBLOCK, M - m0) + (lines ? MBLOCK : 0)) {
        case 1: tile<1, false>(xp, K, wp, g, N, m0, bp, yp, pf, lines); break;
        case 2: tile<2, false>(xp, K, wp, g, N, m0, bp, yp, pf, lines); break;
        case 3: tile<3, false>(xp, K, wp, g, N, m0, bp, yp, pf, lines); break;
        case 4: tile<4, false>(xp, K, wp, g, N, m0, bp, yp, pf, lines); break;
        case 5: tile<1, true>(xp, K, wp, g, N, m0, bp, yp, pf, lines); break;
        case 6: tile<2, true>(xp, K, wp, g, N, m0, bp, yp, pf, lines); break;
        case 7: tile<3, true>(xp, K, wp, g, N, m0, bp, yp, pf, lines); break;
        default: tile<4, true>(xp, K, wp, g, N, m0, bp, yp, pf, lines);
      }
    }
}

}  // namespace d3d::fp32
