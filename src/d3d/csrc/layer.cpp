// d3d::layer: one Llama-family decoder layer over the T new rows of one sequence on the CPU, writing their
// keys and values into the KV cache. Everything that is not a matrix product (norms, rotary embedding,
// attention, SiLU, residuals) is computed row by row here, with sums in a fixed order, and the products
// are int8_linear's or fp32_linear's, whose rows are independent too. So a row's output is bitwise the same
// whether it is a one-token decoding step or one row of a 16-token verification or a token tree: the
// property that keeps speculative decoding exactly lossless, in fp32 and int8. One call per layer also
// replaces the ~25 small torch ops a layer costs in Python.
//
// params (d3d.kernels.layer_params): attention_norm, ffn_norm, q_norm, k_norm (empty: none), then for
// wqkv, wo, w13, w2 in turn five slots: int8 (packed, w_sum, w_scale, smooth, bias) or fp32 (packed,
// -, -, -, bias); empty: none.
#include "d3d.h"

#include <torch/library.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t LANES = 16;  // partial sums of dot(): one 512-bit register, added pairwise at the end

#ifdef __AVX512F__
// The 16 lanes of v added pairwise, in dot()'s order: l + (l + 8), then + 4, + 2, + 1.
inline float reduce16(__m512 v) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}
#endif

// sum_i term(i) in 16 lane sums (term i goes to lane i % 16) reduced pairwise: a fixed order, so the
// same in every call, which the compiler can vectorize without reassociating anything.
template <typename Term>
inline float lane_sum(int64_t n, Term term) {
  float acc[LANES] = {0.f};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int64_t l = 0; l < LANES; ++l) acc[l] += term(i + l);
  for (int64_t l = 0; i < n; ++i, ++l) acc[l] += term(i);
  for (int64_t w = LANES / 2; w > 0; w /= 2)
    for (int64_t l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

// sum_i a[i] * b[i] by lane_sum (the vector path computes exactly what lane_sum does).
inline float dot(const float* a, const float* b, int64_t n) {
#ifdef __AVX512F__
  if (n % LANES == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += LANES)
      acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i)));
    return reduce16(acc);
  }
#endif
  return lane_sum(n, [&](int64_t i) { return a[i] * b[i]; });
}

float sum(const float* a, int64_t n) {
  return lane_sum(n, [&](int64_t i) { return a[i]; });
}

// e^x for x in [-87, 88] (clamped there, so results stay normal floats), to about 2 ulp: 2^k * p(r) with
// k = round(x / ln 2) and a degree-6 polynomial on r = x - k ln 2. Plain arithmetic, no libm call, so a
// loop over it vectorizes and every element gets the same result in any position.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float k = (x * 1.44269504f + 12582912.f) - 12582912.f;  // round to nearest (|k| < 2^22)
  const float r = (x - k * 0.693359375f) + k * 2.12194440e-4f;  // ln 2 in two parts
  float p = 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (int32_t(k) + 127) * (1 << 23);  // 2^k
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

void rms_norm(const float* x, const float* w, int64_t n, float eps, float* out) {
  const float r = 1.f / std::sqrt(dot(x, x, n) / float(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
}

// HF's rotate-half rotary embedding of one head vector v[D] in place.
void rope(float* v, const float* cos, const float* sin, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float x1 = v[j], x2 = v[j + half];
    v[j] = x1 * cos[j] - x2 * sin[j];
    v[j + half] = x2 * cos[j] + x1 * sin[j];
  }
}

std::optional<at::Tensor> given(const at::Tensor& t) {
  return t.numel() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// Linear number `i` (0 wqkv, 1 wo, 2 w13, 3 w2) of the layer on rows x [T, in].
at::Tensor linear(const at::Tensor& x, at::TensorList p, int64_t i) {
  const int64_t b = 4 + 5 * i;
  if (p[b].scalar_type() == at::kFloat) return d3d::fp32_linear(x, p[b], given(p[b + 4]));
  return d3d::int8_linear(x, p[b], p[b + 1], p[b + 2], given(p[b + 3]), given(p[b + 4]));
}

// out[D] += s * v[D] for each visible key in turn (keys[t], or t itself without a key list), with the sums
// held in registers where D is a multiple of 16 up to 128: per element the same additions in the same order.
template <int64_t DV>
void weighted_sum(const float* scores, const int64_t* keys, int64_t n, const float* vc, int64_t D, float* out) {
#ifdef __AVX512F__
  if constexpr (DV > 0) {
    __m512 acc[DV];
    for (int64_t c = 0; c < DV; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const float* v = vc + (keys ? keys[t] : t) * D;
      const __m512 s = _mm512_set1_ps(scores[t]);
      for (int64_t c = 0; c < DV; ++c) acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(s, _mm512_loadu_ps(v + c * LANES)));
    }
    for (int64_t c = 0; c < DV; ++c) _mm512_storeu_ps(out + c * LANES, acc[c]);
    return;
  }
#endif
  std::fill(out, out + D, 0.f);
  for (int64_t t = 0; t < n; ++t) {
    const float* v = vc + (keys ? keys[t] : t) * D;
    for (int64_t d = 0; d < D; ++d) out[d] += scores[t] * v[d];
  }
}

// Attention of one query row and head over the keys it may see, in cache order: with a mask row, those
// it marks; else the causal prefix 0..n_keys - 1. out[D] = softmax(q.k / sqrt(D)) . v.
void attend_row(const float* q, const float* kc, const float* vc, const bool* mask_row, int64_t n_keys,
                int64_t D, float* scores, int64_t* keys, float* out) {
  int64_t n = n_keys;
  if (mask_row) {
    n = 0;
    for (int64_t j = 0; j < n_keys; ++j)
      if (mask_row[j]) keys[n++] = j;
  } else {
    keys = nullptr;
  }
  const float scale = 1.f / std::sqrt(float(D));
  float peak = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) {
    scores[t] = dot(q, kc + (keys ? keys[t] : t) * D, D) * scale;
    peak = std::max(peak, scores[t]);
  }
  for (int64_t t = 0; t < n; ++t) scores[t] = exp_approx(scores[t] - peak);
  const float total = sum(scores, n);
  if (D == 64) weighted_sum<4>(scores, keys, n, vc, D, out);
  else if (D == 128) weighted_sum<8>(scores, keys, n, vc, D, out);
  else weighted_sum<0>(scores, keys, n, vc, D, out);
  const float inv = n ? 1.f / total : 0.f;
  for (int64_t d = 0; d < D; ++d) out[d] *= inv;
}

at::Tensor layer(const at::Tensor& x_, at::TensorList p, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& inv_freq, const at::Tensor& positions_, const std::optional<at::Tensor>& mask_,
                 int64_t start, int64_t H, double eps_) {
  TORCH_CHECK(p.size() == 24, "layer takes 24 parameter tensors (d3d.kernels.layer_params)");
  TORCH_CHECK(x_.dim() == 3 && x_.size(0) == 1 && x_.scalar_type() == at::kFloat, "layer runs one float sequence [1, T, dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4, "layer: KV cache [B, kv_heads, S, D]");
  const int64_t T = x_.size(1), dim = x_.size(2), KV = k_cache.size(1), S = k_cache.size(2), D = k_cache.size(3);
  const int64_t L = start + T, group = H / KV, half = D / 2;
  const float eps = float(eps_);
  TORCH_CHECK(L <= S, "layer: ", L, " tokens exceed the KV cache (", S, ")");
  TORCH_CHECK(H % KV == 0 && inv_freq.numel() == half && positions_.numel() == T, "layer: head shapes do not match");
  const at::Tensor positions = positions_.to(at::kLong).contiguous();
  at::Tensor mask;
  if (mask_.has_value()) {
    mask = mask_->to(at::kBool).contiguous();
    TORCH_CHECK(mask.numel() == T * L, "layer: mask must be [T, start + T]");
  }
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
  const float* fp = inv_freq.data_ptr<float>();
  std::vector<float> cs(half), sn(half);
  for (int64_t i = 0; i < T; ++i) {
    const float pos = float(positions.data_ptr<int64_t>()[i]);
    for (int64_t j = 0; j < half; ++j) {
      const float angle = pos * fp[j];
      cs[j] = std::cos(angle);
      sn[j] = std::sin(angle);
    }
    float* row = qp + i * width;
    for (int64_t head = 0; head < H + KV; ++head) {
      float* v = row + head * D;
      if (p[2].numel()) rms_norm(v, (head < H ? p[2] : p[3]).data_ptr<float>(), D, eps, v);
      rope(v, cs.data(), sn.data(), D);
    }
    for (int64_t g = 0; g < KV; ++g) {
      std::copy(row + (H + g) * D, row + (H + g + 1) * D, kcp + (g * S + start + i) * D);
      std::copy(row + (H + KV + g) * D, row + (H + KV + g + 1) * D, vcp + (g * S + start + i) * D);
    }
  }

  at::Tensor att = at::empty({T, H * D}, x.options());
  float* ap = att.data_ptr<float>();
  const bool* mp = mask.defined() ? mask.data_ptr<bool>() : nullptr;
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
    for (int64_t j = 0; j < inter; ++j) a[j] = g[j] / (1.f + exp_approx(-g[j])) * g[inter + j];
  }
  out += linear(act, p, 3);
  return out.view({1, T, dim});
}

}  // namespace

TORCH_LIBRARY_IMPL(d3d, CPU, m) { m.impl("layer", &layer); }
