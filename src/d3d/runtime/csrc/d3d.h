// d3d's CPU operators (built by d3d/kernels.py): the torch-facing declarations.
#pragma once
#include <ATen/ATen.h>
#include <optional>

#include "vec.h"

namespace d3d {

// y = x @ w.T (+ bias) with x quantized per row and w per output row (int8_linear.cpp).
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_sum, const at::Tensor& w_scale,
                       const std::optional<at::Tensor>& smooth, const std::optional<at::Tensor>& bias);

// y = x @ w.T (+ bias) with 4- or 8-bit weights in Q4_K's scales, activations per 256 (q4_linear.cpp);
// shape: int64 [N, K].
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& factors,
                     const at::Tensor& shape, const std::optional<at::Tensor>& bias);

// y = x @ w.T (+ bias) in fp32, w packed [N/64, K, 64] (fp32_linear.cpp).
at::Tensor fp32_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);

// The same three products on M rows x [M, K] into y [M, N] (N: the weight's outputs), without making tensors: the
// layers (layer.cpp) call them dozens of times a forward, where at::empty and the checks of the operators above cost
// as much as a one-row product of a small model. bias may be null; the arguments are trusted (the layers check them).
void int8_linear_into(const float* x, int64_t M, int64_t K, const at::Tensor& w, const at::Tensor& w_sum,
                      const at::Tensor& w_scale, const float* smooth, const float* bias, float* y);
void q4_linear_into(const float* x, int64_t M, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& factors,
                    int64_t N, int64_t K, const float* bias, float* y);
void fp32_linear_into(const float* x, int64_t M, const at::Tensor& w, const float* bias, float* y);

// Calls of more rows than this (a prompt's) free the working memory they sized instead of keeping it for the next call
// (decoding steps and token trees stay below it): the fp32 pair's 4,096-row pass needs 0.5 GB of it.
constexpr int64_t KEEP_ROWS = 64;

}  // namespace d3d
