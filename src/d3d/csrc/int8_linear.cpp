// d3d::int8_linear: y[m, n] = (sum_k q[m, k] * w[n, k]) * x_scale[m] * w_scale[n] (+ bias[n]), where
// q[m] is row m of x * smooth quantized to symmetric int8 with its own scale x_scale[m]. Each output row
// depends on its own input row only and the integer sums are exact, so a row's result is bitwise the same
// whatever else is in the batch. Weights come packed for VNNI: [N/16][K/4][16][4] int8 (pack_int8).
#include "d3d.h"

#include <torch/library.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define D3D_VNNI 1
#endif

namespace {

constexpr int64_t LANES = 16, MBLOCK = 8;

// Outputs n0 = 16 * nb .. n0 + 15 (those below N) of rows m0 .. m0 + mb - 1: y = float(sum(q * w) - 128 *
// w_sum) * x_scale[m] * w_scale[n] (+ bias[n]), in that order in both paths (built with -ffp-contract=off).
template <int64_t mb>
void block_out(const uint8_t* xq, int64_t K4, const int8_t* wb, int64_t nb, int64_t N, int64_t m0,
               const int32_t* wsum, const float* wsc, const float* xs, const float* bias, float* y) {
  const int64_t n0 = nb * LANES, nl = std::min(LANES, N - n0);
#ifdef D3D_VNNI
  __m512i acc[mb];  // mb is a compile-time constant, so the accumulators stay in registers
  for (int64_t i = 0; i < mb; ++i) acc[i] = _mm512_setzero_si512();
  for (int64_t kk = 0; kk < K4; ++kk) {
    const __m512i w = _mm512_loadu_si512(wb + kk * 64);
    for (int64_t i = 0; i < mb; ++i) {
      int32_t a;
      std::memcpy(&a, xq + (m0 + i) * K4 * 4 + kk * 4, 4);
      acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_set1_epi32(a), w);
    }
  }
  const __mmask16 mask = __mmask16((1u << nl) - 1);
  const __m512i zero_point = _mm512_mullo_epi32(_mm512_set1_epi32(128), _mm512_maskz_loadu_epi32(mask, wsum + n0));
  const __m512 ws = _mm512_maskz_loadu_ps(mask, wsc + n0);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int64_t i = 0; i < mb; ++i) {
    __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i], zero_point));
    v = _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(xs[m0 + i])), ws);
    if (bias) v = _mm512_add_ps(v, b);
    _mm512_mask_storeu_ps(y + (m0 + i) * N + n0, mask, v);
  }
#else
  for (int64_t i = 0; i < mb; ++i)
    for (int64_t l = 0; l < nl; ++l) {
      int32_t s = 0;
      for (int64_t kk = 0; kk < K4; ++kk)
        for (int64_t j = 0; j < 4; ++j)
          s += int32_t(xq[(m0 + i) * K4 * 4 + kk * 4 + j]) * int32_t(wb[kk * 64 + l * 4 + j]);
      float v = float(s - 128 * wsum[n0 + l]) * xs[m0 + i] * wsc[n0 + l];
      y[(m0 + i) * N + n0 + l] = bias ? v + bias[n0 + l] : v;
    }
#endif
}

template <typename... Args>
void block_rows(int64_t mb, Args... args) {
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

// Row m of x (times smooth) as u8 = round(v * (1 / scale)) + 128, scale = max|v| / 127, over Kp slots
// (padding: 128, i.e. zero). Rounding is to nearest even.
float quantize_row(const float* row, const float* smooth, int64_t K, int64_t Kp, uint8_t* q) {
  float peak = 0.f;
  for (int64_t k = 0; k < K; ++k) peak = std::max(peak, std::fabs(smooth ? row[k] * smooth[k] : row[k]));
  const float s = peak > 0.f ? peak / 127.f : 1.f;
  const float inv = 1.f / s;
  for (int64_t k = 0; k < K; ++k)
    q[k] = uint8_t(int32_t(std::nearbyint((smooth ? row[k] * smooth[k] : row[k]) * inv)) + 128);
  for (int64_t k = K; k < Kp; ++k) q[k] = 128;
  return s;
}

}  // namespace

at::Tensor d3d::int8_linear(const at::Tensor& x_, const at::Tensor& w, const at::Tensor& w_sum, const at::Tensor& w_scale,
                       const std::optional<at::Tensor>& smooth_, const std::optional<at::Tensor>& bias_) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && w.scalar_type() == at::kChar && w.dim() == 4 && w.is_contiguous(),
              "int8_linear takes float activations and weights packed by pack_int8");
  const int64_t NB = w.size(0), K4 = w.size(1), N = w_scale.size(0), K = x_.size(-1);
  TORCH_CHECK(K <= K4 * 4 && N <= NB * LANES, "int8_linear: shapes do not match the packed weight");
  at::Tensor x = x_.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0), Kp = K4 * 4;
  at::Tensor xq = at::empty({M, Kp}, x.options().dtype(at::kByte));
  at::Tensor x_scale = at::empty({M}, x.options());
  const float* smooth = smooth_.has_value() ? smooth_->data_ptr<float>() : nullptr;
  for (int64_t m = 0; m < M; ++m)
    x_scale.data_ptr<float>()[m] = quantize_row(x.data_ptr<float>() + m * K, smooth, K, Kp, xq.data_ptr<uint8_t>() + m * Kp);
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* qp = xq.data_ptr<uint8_t>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const int32_t* wsum = w_sum.data_ptr<int32_t>();
  const float* wsc = w_scale.data_ptr<float>();
  const float* xs = x_scale.data_ptr<float>();
  const float* bp = bias_.has_value() ? bias_->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, NB, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t m0 = 0; m0 < M; m0 += MBLOCK)
        block_rows(std::min(MBLOCK, M - m0), qp, K4, wp + nb * K4 * 64, nb, N, m0, wsum, wsc, xs, bp, yp);
  });
  auto shape = x_.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

TORCH_LIBRARY(d3d, m) {
  m.def("int8_linear(Tensor x, Tensor w, Tensor w_sum, Tensor w_scale, Tensor? smooth, Tensor? bias) -> Tensor");
  m.def("fp32_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("layer(Tensor x, Tensor[] params, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor inv_freq, "
        "Tensor positions, Tensor? mask, int start, int n_heads, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(d3d, CPU, m) { m.impl("int8_linear", &d3d::int8_linear); }
