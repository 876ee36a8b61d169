// d3d::fp32_linear: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) in fp32, with every sum taken over k in
// order by fused multiply-adds from zero: a row's result does not depend on the other rows of the call, so
// a one-token step and a row of a 16-token verification give bitwise the same numbers (oneDNN's kernels
// change the order with the number of rows). Weights come packed [N/64][K][64] (d3d.kernels.pack_fp32): a
// tile of up to 4 rows x 64 outputs reads each weight vector once for all its rows, and a one-row call
// streams the weights once, which is what decoding is bound by.
#include "d3d.h"

#include <torch/library.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t GROUP = 64, MBLOCK = 4;

// Rows m0 .. m0 + mb - 1 times outputs 64 g .. 64 g + 63.
// pf: `lines` cache lines to prefetch while the tile computes (from the next group's weights), spread
// evenly over its k steps.
template <int64_t mb, bool prefetch>
void tile(const float* x, int64_t K, const float* w, int64_t g, int64_t N, int64_t m0, const float* bias, float* y,
          const char* pf, int64_t lines) {
  const float* wg = w + g * K * GROUP;
#ifdef __AVX512F__
  const int64_t per_k = (lines + K - 1) / K;
  __m512 acc[mb][4];
  for (int64_t i = 0; i < mb; ++i)
    for (int64_t j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (prefetch)
      for (int64_t p = k * per_k; p < std::min(lines, (k + 1) * per_k); ++p) _mm_prefetch(pf + p * 64, _MM_HINT_T0);
    __m512 wv[4];
    for (int64_t j = 0; j < 4; ++j) wv[j] = _mm512_loadu_ps(wg + k * GROUP + j * 16);
    for (int64_t i = 0; i < mb; ++i) {
      const __m512 a = _mm512_set1_ps(x[(m0 + i) * K + k]);
      for (int64_t j = 0; j < 4; ++j) acc[i][j] = _mm512_fmadd_ps(a, wv[j], acc[i][j]);
    }
  }
  for (int64_t i = 0; i < mb; ++i)
    for (int64_t j = 0; j < 4; ++j) {
      __m512 v = acc[i][j];
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + g * GROUP + j * 16));
      _mm512_storeu_ps(y + (m0 + i) * N + g * GROUP + j * 16, v);
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

}  // namespace

at::Tensor d3d::fp32_linear(const at::Tensor& x_, const at::Tensor& w, const std::optional<at::Tensor>& bias_) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.dim() == 3 && w.size(2) == GROUP
              && w.is_contiguous(), "fp32_linear takes float activations and weights packed by pack_fp32");
  const int64_t G = w.size(0), K = w.size(1), N = G * GROUP;
  TORCH_CHECK(x_.size(-1) == K, "fp32_linear: input width ", x_.size(-1), " does not match the weight (", K, ")");
  at::Tensor x = x_.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = bias_.has_value() ? bias_->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // With several row blocks a group's weights are read once from memory and then again from cache; the
  // next group's weights are prefetched meanwhile, spread over all the passes, so that memory keeps
  // streaming while the later passes compute (a one-pass call is left to the hardware prefetcher).
  const int64_t passes = (M + MBLOCK - 1) / MBLOCK, group_lines = K * GROUP * 4 / 64;
  const int64_t chunk = passes > 1 ? (group_lines + passes - 1) / passes : 0;
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
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
  });
  auto shape = x_.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

TORCH_LIBRARY_IMPL(d3d, CPU, m) { m.impl("fp32_linear", &d3d::fp32_linear); }
