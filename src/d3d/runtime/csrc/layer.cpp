// d3d::layer: one Llama-family decoder layer over the T new rows of one sequence (layers_batch: of several) on the CPU, writing their
// keys and values into the KV cache. Everything that is not a matrix product (norms, rotary embedding,
// attention, SiLU, residuals) is computed row by row here, with sums in a fixed order, and the products
// are int8_linear's or fp32_linear's, whose rows are independent too. So a row's output is bitwise the same
// whether it is a one-token decoding step or one row of a 16-token verification or a token tree: the
// property that keeps speculative decoding exactly lossless, in fp32, int8 and int4. One call per layer (or one
// d3d::layers call for all of them) also replaces the ~25 small torch ops a layer costs in Python.
//
// params (d3d.kernels.layer_params): attention_norm, ffn_norm, q_norm, k_norm (empty: none), then for
// wqkv, wo, w13, w2 in turn five slots: int8 (packed, w_sum, w_scale, smooth, bias), int4 (q, scales,
// factors, shape, bias) or fp32 (packed, -, -, -, bias); empty: none.
#include "d3d.h"
#include "fp32_kernel.h"
#include "layer_kernel.h"
#include "q4_kernel.h"

#include <torch/library.h>
#include <ATen/Parallel.h>
#include <vector>

namespace {

using namespace d3d::rows;

const float* data_or_null(const at::Tensor& t) { return t.numel() ? t.data_ptr<float>() : nullptr; }

// Outputs of linear number `i` (0 wqkv, 1 wo, 2 w13, 3 w2) of the layer.
int64_t out_features(at::TensorList p, int64_t i) {
  const int64_t b = 4 + 5 * i;
  if (p[b].scalar_type() == at::kFloat) return p[b].size(0) * d3d::fp32::GROUP;
  if (p[b].scalar_type() == at::kByte) return p[b + 3].data_ptr<int64_t>()[0];
  return p[b + 2].size(0);
}

// Linear number `i` on rows x [T, K] into y [T, out_features(p, i)].
void linear(const float* x, int64_t T, int64_t K, at::TensorList p, int64_t i, float* y) {
  const int64_t b = 4 + 5 * i;
  if (p[b].scalar_type() == at::kFloat) {
    TORCH_CHECK(p[b].dim() == 3 && p[b].size(1) == K, "layer: fp32 weight ", i, " does not take ", K, " inputs");
    return d3d::fp32_linear_into(x, T, p[b], data_or_null(p[b + 4]), y);
  }
  if (p[b].scalar_type() == at::kByte) {
    const int64_t* shape = p[b + 3].data_ptr<int64_t>();
    TORCH_CHECK(shape[1] == K && p[b].dim() == 3 && (K + d3d::q4::GROUP - 1) / d3d::q4::GROUP == p[b].size(1),
                "layer: int4 weight ", i, " does not take ", K, " inputs");
    return d3d::q4_linear_into(x, T, p[b], p[b + 1], p[b + 2], shape[0], K, data_or_null(p[b + 4]), y);
  }
  TORCH_CHECK(p[b].dim() == 4 && K <= p[b].size(1) * 4, "layer: int8 weight ", i, " does not take ", K, " inputs");
  d3d::int8_linear_into(x, T, K, p[b], p[b + 1], p[b + 2], data_or_null(p[b + 3]), data_or_null(p[b + 4]), y);
}

// What every layer of one call shares: the rows' positions as rotary tables (cos and sin of position * inv_freq,
// [T][D/2], the same values layer after layer) and, per row, where it lives: the KV cache slot of its sequence
// (a batch index), the cache index its key and value are written to, how many keys it may see and its mask row
// (nullptr: causal, the first n_keys). One sequence is the batch of one segment.
struct Rows {
  int64_t T = 0;
  std::vector<float> cs, sn;
  std::vector<int64_t> slot, write, n_keys;
  std::vector<const bool*> mask_row;
  std::vector<at::Tensor> masks;  // owners of mask_row's memory
};

void rope_tables(Rows& r, const at::Tensor& inv_freq, const at::Tensor& positions_) {
  const int64_t half = inv_freq.numel(), T = r.T;
  TORCH_CHECK(positions_.numel() == T, "layer: one position per row");
  r.cs.assign(T * half, 0.f);
  r.sn.assign(T * half, 0.f);
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
}

// Rows of one segment: `length` rows of the sequence in cache slot `slot`, after its first `start` cached
// tokens, with its mask (bool [length, start + length]; undefined: causal).
void add_segment(Rows& r, int64_t slot, int64_t start, int64_t length, const at::Tensor& mask_) {
  const int64_t L = start + length;
  const bool* mp = nullptr;
  if (mask_.defined() && mask_.numel()) {
    at::Tensor mask = mask_.to(at::kBool).contiguous();
    TORCH_CHECK(mask.numel() == length * L, "layer: mask must be [T, start + T]");
    r.masks.push_back(mask);
    mp = mask.data_ptr<bool>();
  }
  for (int64_t i = 0; i < length; ++i) {
    r.slot.push_back(slot);
    r.write.push_back(start + i);
    r.n_keys.push_back(mp ? L : start + i + 1);
    r.mask_row.push_back(mp ? mp + i * L : nullptr);
  }
}

Rows rows_of(const at::Tensor& inv_freq, const at::Tensor& positions, const std::optional<at::Tensor>& mask,
             int64_t T, int64_t start) {
  Rows r;
  r.T = T;
  rope_tables(r, inv_freq, positions);
  add_segment(r, 0, start, T, mask.has_value() ? *mask : at::Tensor());
  return r;
}

// Attention's share of work: rows i0 .. i1 - 1 (of one sequence) with query heads h0 .. h1 - 1 (of one KV group),
// which attend_rows takes together, reading the group's keys and values once for all of them.
struct AttentionTask {
  int64_t i0, i1, h0, h1;
};

// Tasks of whole KV groups over up to 8 consecutive rows of a sequence, or of fewer rows, down to one row and one
// head, where that would leave the threads fewer than two tasks each.
std::vector<AttentionTask> attention_tasks(const Rows& r, int64_t KV, int64_t group, int64_t threads) {
  std::vector<AttentionTask> tasks;
  for (int64_t rows = 8; rows >= 1; rows /= 2) {
    tasks.clear();
    for (int64_t i0 = 0; i0 < r.T;) {
      int64_t i1 = i0 + 1;
      while (i1 < r.T && i1 - i0 < rows && r.slot[i1] == r.slot[i0]) ++i1;
      for (int64_t g = 0; g < KV; ++g) tasks.push_back({i0, i1, g * group, (g + 1) * group});
      i0 = i1;
    }
    if (int64_t(tasks.size()) >= 2 * threads) return tasks;
  }
  std::vector<AttentionTask> heads;
  for (const AttentionTask& a : tasks)
    for (int64_t h = a.h0; h < a.h1; ++h) heads.push_back({a.i0, a.i1, h, h + 1});
  return heads;
}

// Working memory of the layers of one call, sized on first use and reused layer after layer (tensors made per layer
// cost more than a small model's one-row products).
struct Buffers {
  std::vector<float> h, qkv, att, gu, act, y;
};

float* sized(std::vector<float>& v, int64_t n) {
  if (int64_t(v.size()) < n) v.resize(n);
  return v.data();
}

// One layer over the rows r of x [T, dim] into out [T, dim] (out may be x).
void layer_rows(const float* x, float* out, int64_t dim, at::TensorList p, const at::Tensor& k_cache,
                const at::Tensor& v_cache, const Rows& r, int64_t H, float eps, Buffers& buf) {
  TORCH_CHECK(p.size() == 24, "layer takes 24 parameter tensors (d3d.kernels.layer_params)");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
              k_cache.scalar_type() == at::kFloat && v_cache.sizes() == k_cache.sizes() &&
              v_cache.scalar_type() == at::kFloat, "layer: KV cache [B, kv_heads, S, D]");
  const int64_t T = r.T, B = k_cache.size(0), KV = k_cache.size(1), S = k_cache.size(2);
  const int64_t D = k_cache.size(3), group = H / KV, half = D / 2;
  TORCH_CHECK(H % KV == 0 && int64_t(r.cs.size()) == T * half, "layer: head shapes do not match");
  for (int64_t i = 0; i < T; ++i) {
    TORCH_CHECK(r.n_keys[i] <= S && r.write[i] < S, "layer: ", r.n_keys[i], " tokens exceed the KV cache (", S, ")");
    TORCH_CHECK(0 <= r.slot[i] && r.slot[i] < B, "layer: cache slot ", r.slot[i], " outside the cache's ", B);
  }
  const int64_t width = (H + 2 * KV) * D;
  TORCH_CHECK(out_features(p, 0) == width, "layer: wqkv does not match the heads");
  TORCH_CHECK(out_features(p, 1) == dim && out_features(p, 3) == dim, "layer: wo and w2 must give ", dim, " outputs");

  float* h = sized(buf.h, T * dim);
  for (int64_t i = 0; i < T; ++i) rms_norm(x + i * dim, p[0].data_ptr<float>(), dim, eps, h + i * dim);
  float* qp = sized(buf.qkv, T * width);
  linear(h, T, dim, p, 0, qp);
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
      const int64_t at = ((r.slot[i] * KV + g) * S + r.write[i]) * D;
      std::copy(row + (H + g) * D, row + (H + g + 1) * D, kcp + at);
      std::copy(row + (H + KV + g) * D, row + (H + KV + g + 1) * D, vcp + at);
    }
  }

  float* ap = sized(buf.att, T * H * D);
  const std::vector<AttentionTask> tasks = attention_tasks(r, KV, group, at::get_num_threads());
  at::parallel_for(0, int64_t(tasks.size()), 1, [&](int64_t b, int64_t e) {
    AttendScratch scratch;
    for (int64_t t = b; t < e; ++t) {
      const AttentionTask& a = tasks[t];
      const int64_t base = (r.slot[a.i0] * KV + a.h0 / group) * S * D;
      attend_rows(qp + a.i0 * width + a.h0 * D, width, a.i1 - a.i0, a.h1 - a.h0, r.mask_row.data() + a.i0,
                  r.n_keys.data() + a.i0, kcp + base, vcp + base, D, ap + a.i0 * H * D + a.h0 * D, H * D, scratch);
    }
  });

  float* y = sized(buf.y, T * dim);
  linear(ap, T, H * D, p, 1, y);
  for (int64_t j = 0; j < T * dim; ++j) out[j] = x[j] + y[j];  // elementwise: the same for every row
  for (int64_t i = 0; i < T; ++i) rms_norm(out + i * dim, p[1].data_ptr<float>(), dim, eps, h + i * dim);
  const int64_t inter = out_features(p, 2) / 2;
  float* gu = sized(buf.gu, T * 2 * inter);
  linear(h, T, dim, p, 2, gu);
  float* act = sized(buf.act, T * inter);
  for (int64_t i = 0; i < T; ++i) silu_mul(gu + i * 2 * inter, gu + i * 2 * inter + inter, inter, act + i * inter);
  linear(act, T, inter, p, 3, y);
  for (int64_t j = 0; j < T * dim; ++j) out[j] += y[j];
}

// The layers params[0 .. n) in turn over x [1, T, dim], a new tensor out.
at::Tensor run_layers(const at::Tensor& x_, at::TensorList p, at::TensorList k_caches, at::TensorList v_caches,
                      const Rows& r, int64_t H, float eps) {
  TORCH_CHECK(x_.dim() == 3 && x_.size(0) == 1 && x_.scalar_type() == at::kFloat, "layer runs float rows [1, T, dim]");
  TORCH_CHECK(x_.size(1) == r.T, "layer: ", x_.size(1), " rows for ", r.T, " positions");
  TORCH_CHECK(k_caches.size() == v_caches.size() && p.size() == 24 * k_caches.size(),
              "layers take 24 parameter tensors and a K and a V cache per layer");
  const at::Tensor x = x_.contiguous();
  const int64_t dim = x.size(2);
  at::Tensor out = at::empty_like(x);
  thread_local Buffers buf;
  const float* in = x.data_ptr<float>();
  for (size_t i = 0; i < k_caches.size(); ++i) {
    layer_rows(in, out.data_ptr<float>(), dim, p.slice(24 * i, 24), k_caches[i], v_caches[i], r, H, eps, buf);
    in = out.data_ptr<float>();  // the layers after the first work in place: each reads a row before writing it
  }
  if (k_caches.empty()) out.copy_(x);
  if (r.T > d3d::KEEP_ROWS) buf = Buffers();  // a prompt's buffers (the pair's 4,096 rows: 0.5 GB) are not kept
  return out;
}

at::Tensor layer(const at::Tensor& x, at::TensorList p, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& inv_freq, const at::Tensor& positions, const std::optional<at::Tensor>& mask,
                 int64_t start, int64_t H, double eps) {
  TORCH_CHECK(x.dim() == 3, "layer runs one float sequence [1, T, dim]");
  return run_layers(x, p, {k_cache}, {v_cache}, rows_of(inv_freq, positions, mask, x.size(1), start), H, float(eps));
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
  return run_layers(x, p, k_caches, v_caches, rows_of(inv_freq, positions, mask, x.size(1), start), H, float(eps));
}

// All layers over the rows of several sequences at once (continuous batching, d3d.scheduler): segment s is
// lengths[s] consecutive rows of x, the next tokens of the sequence in cache slot slots[s] after its starts[s]
// cached tokens, with masks[s] (empty: causal). The products take all rows together; everything else is per
// row, so each row is bitwise what the same rows compute in a call of their own.
at::Tensor layers_batch(const at::Tensor& x, at::TensorList p, at::TensorList k_caches, at::TensorList v_caches,
                        const at::Tensor& inv_freq, const at::Tensor& positions, at::TensorList masks,
                        at::IntArrayRef slots, at::IntArrayRef starts, at::IntArrayRef lengths, int64_t H, double eps) {
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1, "layers_batch runs rows [1, T, dim]");
  TORCH_CHECK(k_caches.size() == v_caches.size() && p.size() == 24 * k_caches.size(),
              "layers_batch takes 24 parameter tensors and a K and a V cache per layer");
  const size_t n = slots.size();
  TORCH_CHECK(starts.size() == n && lengths.size() == n && masks.size() == n, "layers_batch: one slot, start, "
              "length and mask per segment");
  Rows r;
  for (size_t s = 0; s < n; ++s) {
    TORCH_CHECK(lengths[s] > 0 && starts[s] >= 0, "layers_batch: empty segment or negative start");
    for (size_t t = 0; t < s; ++t) TORCH_CHECK(slots[t] != slots[s], "layers_batch: two segments in cache slot ", slots[s]);
    add_segment(r, slots[s], starts[s], lengths[s], masks[s]);
  }
  r.T = int64_t(r.slot.size());
  TORCH_CHECK(x.size(1) == r.T, "layers_batch: ", x.size(1), " rows for segments of ", r.T);
  rope_tables(r, inv_freq, positions);
  return run_layers(x, p, k_caches, v_caches, r, H, float(eps));
}

}  // namespace

TORCH_LIBRARY_IMPL(d3d, CPU, m) {
  m.impl("layer", &layer);
  m.impl("layers", &layers);
  m.impl("layers_batch", &layers_batch);
}
