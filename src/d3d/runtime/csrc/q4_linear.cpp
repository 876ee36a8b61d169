// d3d::q4_linear: the torch operator over q4_kernel.h (which says what it computes and why).
#include "d3d.h"
#include "q4_kernel.h"

#include <torch/library.h>
#include <ATen/Parallel.h>
#include <vector>

void d3d::q4_linear_into(const float* x, int64_t M, const at::Tensor& q, const at::Tensor& scales,
                         const at::Tensor& factors, int64_t N, int64_t K, const float* bias, float* y) {
  using namespace d3d::q4;
  const int64_t NB = q.size(0), SB = (K + SUPER - 1) / SUPER, bits = 4 * q.size(2) / GROUP_BYTES;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xs;
  thread_local std::vector<int32_t> xsum;
  xq.resize(M * SB * SUPER);
  xs.resize(M * SB);
  xsum.resize(M * SB * GROUPS);
  for (int64_t m = 0; m < M; ++m)
    quantize_row(x + m * K, K, xq.data() + m * SB * SUPER, xs.data() + m * SB, xsum.data() + m * SB * GROUPS);
  // the pointers are taken here: inside the lambda, on a worker thread, xq would name that thread's buffer
  const int8_t* qx = xq.data();
  const float* sx = xs.data();
  const int32_t* gx = xsum.data();
  at::parallel_for(0, NB, 4, [&](int64_t b0, int64_t b1) {
    blocks(bits, qx, M, K, sx, gx, q.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), factors.data_ptr<float>(), N,
           bias, y, b0, b1);
  });
  if (M > KEEP_ROWS) {  // a prompt's quantized rows are not kept
    std::vector<int8_t>().swap(xq);
    std::vector<float>().swap(xs);
    std::vector<int32_t>().swap(xsum);
  }
}

at::Tensor d3d::q4_linear(const at::Tensor& x_, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& factors,
                          const at::Tensor& shape, const std::optional<at::Tensor>& bias_) {
  using namespace d3d::q4;
  TORCH_CHECK(x_.scalar_type() == at::kFloat && q.scalar_type() == at::kByte && q.dim() == 3 && q.is_contiguous() &&
              scales.is_contiguous() && factors.is_contiguous() && factors.scalar_type() == at::kFloat,
              "q4_linear takes float activations and weights packed by pack_q4");
  const int64_t N = shape.data_ptr<int64_t>()[0], K = shape.data_ptr<int64_t>()[1];
  const int64_t NB = q.size(0), SB = (K + SUPER - 1) / SUPER, bits = 4 * q.size(2) / GROUP_BYTES;
  TORCH_CHECK(x_.size(-1) == K && (K + GROUP - 1) / GROUP == q.size(1) && N <= NB * LANES && (bits == 4 || bits == 6 || bits == 8) &&
              scales.numel() == NB * SB * SCALES && factors.numel() == NB * SB * FACTORS,
              "q4_linear: shapes do not match the packed weight");
  at::Tensor x = x_.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  q4_linear_into(x.data_ptr<float>(), M, q, scales, factors, N, K, bias_.has_value() ? bias_->data_ptr<float>() : nullptr,
                 y.data_ptr<float>());
  auto out = x_.sizes().vec();
  out.back() = N;
  return y.view(out);
}

TORCH_LIBRARY_IMPL(d3d, CPU, m) { m.impl("q4_linear", &d3d::q4_linear); }
