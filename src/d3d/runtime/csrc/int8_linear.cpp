// d3d::int8_linear: the torch operator over int8_kernel.h (which says what it computes and why), and the
// schema of all of d3d's operators.
#include "d3d.h"
#include "int8_kernel.h"
#include "q4_kernel.h"

#include <torch/library.h>
#include <ATen/Parallel.h>
#include <string>

void d3d::int8_linear_into(const float* x, int64_t M, int64_t K, const at::Tensor& w, const at::Tensor& w_sum,
                           const at::Tensor& w_scale, const float* smooth, const float* bias, float* y) {
  const int64_t NB = w.size(0), K4 = w.size(1), N = w_scale.size(0), Kp = K4 * 4;
  thread_local std::vector<uint8_t> xq;
  thread_local std::vector<float> x_scale;
  xq.resize(M * Kp);
  x_scale.resize(M);
  for (int64_t m = 0; m < M; ++m) x_scale[m] = d3d::int8::quantize_row(x + m * K, smooth, K, Kp, xq.data() + m * Kp);
  const uint8_t* qp = xq.data();  // taken here: inside the lambda, on a worker thread, xq is that thread's buffer
  const int8_t* wp = w.data_ptr<int8_t>();
  const int32_t* wsum = w_sum.data_ptr<int32_t>();
  const float* wsc = w_scale.data_ptr<float>();
  const float* xs = x_scale.data();
  at::parallel_for(0, NB, 4, [&](int64_t b0, int64_t b1) {
    d3d::int8::blocks(qp, M, K4, wp, N, wsum, wsc, xs, bias, y, b0, b1);
  });
  if (M > KEEP_ROWS) {  // a prompt's quantized rows are not kept
    std::vector<uint8_t>().swap(xq);
    std::vector<float>().swap(x_scale);
  }
}

at::Tensor d3d::int8_linear(const at::Tensor& x_, const at::Tensor& w, const at::Tensor& w_sum, const at::Tensor& w_scale,
                       const std::optional<at::Tensor>& smooth_, const std::optional<at::Tensor>& bias_) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && w.scalar_type() == at::kChar && w.dim() == 4 && w.is_contiguous(),
              "int8_linear takes float activations and weights packed by pack_int8");
  const int64_t NB = w.size(0), K4 = w.size(1), N = w_scale.size(0), K = x_.size(-1);
  TORCH_CHECK(K <= K4 * 4 && N <= NB * d3d::int8::LANES, "int8_linear: shapes do not match the packed weight");
  at::Tensor x = x_.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  int8_linear_into(x.data_ptr<float>(), M, K, w, w_sum, w_scale, smooth_.has_value() ? smooth_->data_ptr<float>() : nullptr,
                   bias_.has_value() ? bias_->data_ptr<float>() : nullptr, y.data_ptr<float>());
  auto shape = x_.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

TORCH_LIBRARY(d3d, m) {
  m.def("int8_linear(Tensor x, Tensor w, Tensor w_sum, Tensor w_scale, Tensor? smooth, Tensor? bias) -> Tensor");
  m.def("q4_linear(Tensor x, Tensor q, Tensor scales, Tensor factors, Tensor shape, Tensor? bias) -> Tensor");
  m.def("fp32_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("layer(Tensor x, Tensor[] params, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor inv_freq, "
        "Tensor positions, Tensor? mask, int start, int n_heads, float eps) -> Tensor");
  m.def("layers(Tensor x, Tensor[] params, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor inv_freq, "
        "Tensor positions, Tensor? mask, int start, int n_heads, float eps) -> Tensor");
  m.def("layers_batch(Tensor x, Tensor[] params, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor inv_freq, "
        "Tensor positions, Tensor[] masks, int[] slots, int[] starts, int[] lengths, int n_heads, float eps) -> Tensor");
  m.def("kernel_path() -> str", [] { return std::string(d3d::kernel_path()); });
  m.def("int8_path() -> str", [] { return std::string(d3d::int8::int8_path()); });
  m.def("q4_path() -> str", [] { return std::string(d3d::q4::q4_path()); });
}

TORCH_LIBRARY_IMPL(d3d, CPU, m) { m.impl("int8_linear", &d3d::int8_linear); }
