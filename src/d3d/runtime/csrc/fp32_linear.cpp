// d3d::fp32_linear: the torch operator over fp32_kernel.h (which says what it computes and why).
#include "d3d.h"
#include "fp32_kernel.h"

#include <torch/library.h>
#include <ATen/Parallel.h>

at::Tensor d3d::fp32_linear(const at::Tensor& x_, const at::Tensor& w, const std::optional<at::Tensor>& bias_) {
  using d3d::fp32::GROUP;
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
  if (M == 1)  // a decoding step: shared out in half groups, so an odd number of groups splits evenly too
    at::parallel_for(0, 2 * G, 1, [&](int64_t h0, int64_t h1) { d3d::fp32::halves(xp, K, wp, G, bp, yp, h0, h1); });
  else
    at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) { d3d::fp32::groups(xp, M, K, wp, G, bp, yp, g0, g1); });
  auto shape = x_.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

TORCH_LIBRARY_IMPL(d3d, CPU, m) { m.impl("fp32_linear", &d3d::fp32_linear); }
