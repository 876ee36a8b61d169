// d3d's CPU int8 operators (see d3d/int8_kernel.py): shared declarations.
#pragma once
#include <ATen/ATen.h>
#include <optional>

namespace d3d {

// y = x @ w.T (+ bias) with x quantized per row and w per output row (int8_linear.cpp).
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_sum, const at::Tensor& w_scale,
                       const std::optional<at::Tensor>& smooth, const std::optional<at::Tensor>& bias);

}  // namespace d3d
