// d3d::layer: one Llama-family decoder layer over the T new rows of one sequence on the CPU, writing their
// keys and values into the KV cache. Everything that is not a matrix product (norms, rotary embedding,
// attention, SiLU, residuals) is computed row by row here, with sums in a fixed order, and the products
// are int8_linear's or fp32_linear's, whose rows are independent too. So a row's output is bitwise the same
// whether it is a one-token decoding step or one row of a 16-token verification or a token tree: the
// property that keeps speculative decoding exactly lossless, in fp32 and int8. One call per layer (or one
// d3d::layers call for all of them) also replaces the ~25 small torch ops a layer costs in Python.
//
// params (d3d.kernels.layer_params): attention_norm, ffn_norm, q_norm, k_norm (empty: none), then for
// wqkv, wo, w13, w2 in turn five slots: int8 (packed, w_sum, w_scale, smooth, bias) or fp32 (packed,
// -, -, -, bias); empty: none.
#include "d3d.h"
#include "layer_kernel.h"

#include <torch/library.h>
#include <ATen/Parallel.h>
#include <vector>

namespace {

using namespace d3d::rows;

std::optional<at::Tensor> given(const at::Tensor& t) {
  return t.numel() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// Linear number `i` (0 wqkv, 1 wo, 2 w13, 3 w2) of the layer on rows x [T, in].
at::Tensor linear(const at::Tensor& x, at::TensorList p, int64_t i) {
  const int64_t b = 4 + 5 * i;
  if (p[b].scalar_type() == at::kFloat) return d3d::fp32_linear(x, p[b], given(p[b + 4]));
  return d3d::int8_linear(x, p[b], p[b + 1], p[b + 2], given(p[b + 3]), given(p[b + 4]));
}

// What every layer of one call shares: the rows' positions as rotary tables (cos and sin of position * inv_freq,
// [T][D/2], the same values layer after layer) and the mask.
struct Rows {
  int64_t T, start, L;
  std::vector<float> cs, sn;
  at::Tensor mask;  // bool [T, L], or undefined: causal
};

Rows rows_of(const at::Tensor& inv_freq, const at::Tensor& positions_, const std::optional<at::Tensor>& mask_,
             int64_t T, int64_t start) {
  const int64_t half = inv_freq.numel();
  TORCH_CHECK(positions_.numel() == T, "layer: one position per row");
  Rows r{T, start, start + T, std::vector<float>(T * half), std::vector<float>(T * half), at::Tensor()};
  const at::Tensor positions = positions_.to(at::kLong).contiguous();
  const float* fp = inv_freq.data_ptr<float>();
  for (int64_t i = 0; i < T; ++i) {
    const float pos = float(positions.data_ptr<int64_t>()[i]);
    for (int64_t j = 0; j < half; ++j) {
      const float angle = pos * fp[j];
      r.cs[i * half + j] = std::cos(angle);
      r.sn[i * half + j] = std::sin(angle);
    }
  }
  if (mask_.has_value()) {
    r.mask = mask_->to(at::kBool).contiguous();
    TORCH_CHECK(r.mask.numel() == T * r.L, "layer: mask must be [T, start + T]");
  }
  return r;
}

at::Tensor layer_rows(const at::Tensor& x_, at::TensorList p, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const Rows& r, int64_t H, float eps) {
  TORCH_CHECK(p.size() == 24, "layer takes 24 parameter tensors (d3d.kernels.layer_params)");
  TORCH_CHECK(x_.dim() == 3 && x_.size(0) == 1 && x_.scalar_type() == at::kFloat, "layer runs one float sequence [1, T, dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4, "layer: KV cache [B, kv_heads, S, D]");
  const int64_t T = r.T, dim = x_.size(2), KV = k_cache.size(1), S = k_cache.size(2), D = k_cache.size(3);
  const int64_t start = r.start, L = r.L, group = H / KV, half = D / 2;
  TORCH_CHECK(x_.size(1) == T, "layer: ", x_.size(1), " rows for ", T, " positions");
  TORCH_CHECK(L <= S, "layer: ", L, " tokens exceed the KV cache (", S, ")");
  TORCH_CHECK(H % KV == 0 && int64_t(r.cs.size()) == T * half, "layer: head shapes do not match");
  at::Tensor x = x_.reshape({T, dim}).contiguous();
  const float* xp = x.data_ptr<float>();

  at::Tensor h = at::empty({T, dim}, x.options());
  for (int64_t i = 0; i < T; ++i) rms_norm(xp + i * dim, p[0].data_ptr<float>(), dim, eps, h.data_ptr<float>() + i * dim);
  at::Tensor qkv = linear(h, p, 0).contiguous();
  const int64_t width = (H + 2 * KV) * D;
  TORCH_CHECK(qkv.size(1) == width, "layer: wqkv does not match the heads");
  float* qp = qkv.data_ptr<float>();
  float* kcp = k_cache.data_ptr<float>();
  float* vcp = v_cache.data_ptr<float>();
  for (int64_t i = 0; i < T; ++i) {
    float* row = qp + i * width;
    for (int64_t head = 0; head < H + KV; ++head) {
      float* v = row + head * D;
      if (p[2].numel()) rms_norm(v, (head < H ? p[2] : p[3]).data_ptr<float>(), D, eps, v);
      rope(v, r.cs.data() + i * half, r.sn.data() + i * half, D);
    }
    for (int64_t g = 0; g < KV; ++g) {
      std::copy(row + (H + g) * D, row + (H + g + 1) * D, kcp + (g * S + start + i) * D);
      std::copy(row + (H + KV + g) * D, row + (H + KV + g + 1) * D, vcp + (g * S + start + i) * D);
    }
  }

  at::Tensor att = at::empty({T, H * D}, x.options());
  float* ap = att.data_ptr<float>();
  const bool* mp = r.mask.defined() ? r.mask.data_ptr<bool>() : nullptr;
  at::parallel_for(0, T * H, 1, [&](int64_t b, int64_t e) {
    std::vector<float> scores(L);
    std::vector<int64_t> keys(L);
    for (int64_t task = b; task < e; ++task) {
      const int64_t i = task / H, head = task % H, g = head / group;
      attend_row(qp + i * width + head * D, kcp + g * S * D, vcp + g * S * D, mp ? mp + i * L : nullptr,
                 mp ? L : start + i + 1, D, scores.data(), keys.data(), ap + i * H * D + head * D);
    }
  });

  at::Tensor out = x + linear(att, p, 1);  // elementwise: the same for every row
  for (int64_t i = 0; i < T; ++i)
    rms_norm(out.data_ptr<float>() + i * dim, p[1].data_ptr<float>(), dim, eps, h.data_ptr<float>() + i * dim);
  at::Tensor gu = linear(h, p, 2).contiguous();
  const int64_t inter = gu.size(1) / 2;
  at::Tensor act = at::empty({T, inter}, x.options());
  for (int64_t i = 0; i < T; ++i) {
    const float* g = gu.data_ptr<float>() + i * 2 * inter;
    float* a = act.data_ptr<float>() + i * inter;
    silu_mul(g, g + inter, inter, a);
  }
  out += linear(act, p, 3);
  return out.view({1, T, dim});
}

at::Tensor layer(const at::Tensor& x, at::TensorList p, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& inv_freq, const at::Tensor& positions, const std::optional<at::Tensor>& mask,
                 int64_t start, int64_t H, double eps) {
  TORCH_CHECK(x.dim() == 3, "layer runs one float sequence [1, T, dim]");
  return layer_rows(x, p, k_cache, v_cache, rows_of(inv_freq, positions, mask, x.size(1), start), H, float(eps));
}

// All of a model's layers in turn, params holding each layer's 24 tensors one after the other: one call
// per forward instead of one per layer (each costs a dispatch from Python, and the rotary tables are made
// once), with the same arithmetic as that many layer calls.
at::Tensor layers(const at::Tensor& x, at::TensorList p, at::TensorList k_caches, at::TensorList v_caches,
                  const at::Tensor& inv_freq, const at::Tensor& positions, const std::optional<at::Tensor>& mask,
                  int64_t start, int64_t H, double eps) {
  TORCH_CHECK(x.dim() == 3, "layers run one float sequence [1, T, dim]");
  TORCH_CHECK(k_caches.size() == v_caches.size() && p.size() == 24 * k_caches.size(),
              "layers takes 24 parameter tensors and a K and a V cache per layer");
  const Rows r = rows_of(inv_freq, positions, mask, x.size(1), start);
  at::Tensor h = x;
  for (size_t i = 0; i < k_caches.size(); ++i)
    h = layer_rows(h, p.slice(24 * i, 24), k_caches[i], v_caches[i], r, H, float(eps));
  return h;
}

}  // namespace

TORCH_LIBRARY_IMPL(d3d, CPU, m) {
  m.impl("layer", &layer);
  m.impl("layers", &layers);
}
