// d3d::fp32_linear: the torch operator over fp32_kernel.h (which says what it computes and why).
#include "d3d.h"
#include "fp32_kernel.h"

#include <torch/library.h>
#include <ATen/Parallel.h>

void d3d::fp32_linear_into(const float* x, int64_t M, const at::Tensor& w, const float* bias, float* y) {
  using d3d::fp32::GROUP;
  const int64_t G = w.size(0), K = w.size(1);
  const float* wp = w.data_ptr<float>();
  if (M == 1)  // a decoding step: shared out in half groups, so an odd number of groups splits evenly too
    at::parallel_for(0, 2 * G, 1, [&](int64_t h0, int64_t h1) { d3d::fp32::halves(x, K, wp, G, bias, y, h0, h1); });
  else
    at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) { d3d::fp32::groups(x, M, K, wp, G, bias, y, g0, g1); });
}

at::Tensor d3d::fp32_linear(const at::Tensor& x_, const at::Tensor& w, const std::optional<at::Tensor>& bias_) {
  using d3d::fp32::GROUP;
  TORCH_CHECK(x_.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.dim() == 3 && w.size(2) == GROUP
              && w.is_contiguous(), "fp32_linear takes float activations and weights packed by pack_fp32");
  const int64_t G = w.size(0), K = w.size(1), N = G * GROUP;
  TORCH_CHECK(x_.size(-1) == K, "fp32_linear: input width ", x_.size(-1), " does not match the weight (", K, ")");
  at::Tensor x = x_.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  fp32_linear_into(x.data_ptr<float>(), M, w, bias_.has_value() ? bias_->data_ptr<float>() : nullptr, y.data_ptr<float>());
  auto shape = x_.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

TORCH_LIBRARY_IMPL(d3d, CPU, m) { m.impl("fp32_linear", &d3d::fp32_linear); }
