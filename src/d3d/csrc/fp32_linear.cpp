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
template <int64_t mb>
void tile(const float* x, int64_t K, const float* w, int64_t g, int64_t N, int64_t m0, const float* bias, float* y) {
  const float* wg = w + g * K * GROUP;
#ifdef __AVX512F__
  __m512 acc[mb][4];
  for (int64_t i = 0; i < mb; ++i)
    for (int64_t j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
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
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t m0 = 0; m0 < M; m0 += MBLOCK) {
        switch (std::min(MBLOCK, M - m0)) {
          case 1: tile<1>(xp, K, wp, g, N, m0, bp, yp); break;
          case 2: tile<2>(xp, K, wp, g, N, m0, bp, yp); break;
          case 3: tile<3>(xp, K, wp, g, N, m0, bp, yp); break;
          default: tile<4>(xp, K, wp, g, N, m0, bp, yp);
        }
      }
  });
  auto shape = x_.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

TORCH_LIBRARY_IMPL(d3d, CPU, m) { m.impl("fp32_linear", &d3d::fp32_linear); }
