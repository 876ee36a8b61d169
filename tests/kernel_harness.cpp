// The C++ kernels' loops without torch, on fixed inputs: prints one line per case, "name hash", where hash
// is FNV-1a over the output bits. Built once per vector path (and cross-built for aarch64, run under qemu)
// by tests/test_kernel_paths.py, which checks that every build prints the same lines: the fp32 products
// (1 to 16 rows, whole and partial k chunks, one row shared out at a half group), the int8 products with
// row quantization, the int4 products (4, 6 and 8 bits, a partial super-block), and a layer's row-by-row parts (norm, rotary, attention with and without a mask at
// head dims 64 and 128, SiLU).
// Only IEEE-exact operations are involved (no libm beyond sqrt, fabs and nearbyint), so the lines are the
// same on every CPU, not only on every path of one CPU.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "fp32_kernel.h"
#include "int8_kernel.h"
#include "layer_kernel.h"
#include "q4_kernel.h"

namespace {

uint64_t state = 88172645463325252ull;

// A deterministic float in [-scale, scale) from a xorshift generator (the same on every machine).
float next(float scale = 1.f) {
  state ^= state << 13;
  state ^= state >> 7;
  state ^= state << 17;
  return (float((state >> 40) & 0xFFFFFF) / float(1 << 24) * 2.f - 1.f) * scale;
}

std::vector<float> randoms(size_t n, float scale = 1.f) {
  std::vector<float> v(n);
  for (float& x : v) x = next(scale);
  return v;
}

template <typename T>
void print(const char* name, const std::vector<T>& v) {
  uint64_t h = 1469598103934665603ull;
  const auto* p = reinterpret_cast<const unsigned char*>(v.data());
  for (size_t i = 0; i < v.size() * sizeof(T); ++i) h = (h ^ p[i]) * 1099511628211ull;
  std::printf("%s %016llx\n", name, static_cast<unsigned long long>(h));
}

void fp32_products() {
  for (int64_t K : {576, 100}) {
    const int64_t G = 3, N = G * d3d::fp32::GROUP;
    std::vector<float> w = randoms(G * K * d3d::fp32::GROUP), bias = randoms(N);
    for (int64_t M : {1, 2, 3, 4, 5, 7, 16}) {
      std::vector<float> x = randoms(M * K), y(M * N);
      d3d::fp32::groups(x.data(), M, K, w.data(), G, bias.data(), y.data(), 0, G);
      char name[64];
      std::snprintf(name, sizeof name, "fp32 %lldx%lld", static_cast<long long>(M), static_cast<long long>(K));
      print(name, y);
      if (M == 1) {  // as two threads share a one-row product of 3 groups: 1.5 groups each
        std::vector<float> split(N);
        d3d::fp32::halves(x.data(), K, w.data(), G, bias.data(), split.data(), 0, G);
        d3d::fp32::halves(x.data(), K, w.data(), G, bias.data(), split.data(), G, 2 * G);
        print((std::string(name) + " in half groups").c_str(), split);
      }
    }
  }
}

void int8_products() {
  const int64_t N = 200, K = 99, K4 = (K + 3) / 4, NB = (N + d3d::int8::LANES - 1) / d3d::int8::LANES;
  std::vector<int8_t> w(NB * K4 * 64);
  for (int8_t& b : w) b = int8_t(int(next(127.5f)));
  std::vector<int32_t> wsum(N, 0);  // only the VNNI path reads it: sum of each output row's weights
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K4 * 4; ++k) wsum[n] += w[(n / 16) * K4 * 64 + (k / 4) * 64 + (n % 16) * 4 + k % 4];
  std::vector<float> wsc = randoms(N, 0.01f), bias = randoms(N), smooth = randoms(K);
  for (float& s : smooth) s = s + 1.5f;
  for (int64_t M : {1, 4, 9, 16}) {
    std::vector<float> x = randoms(M * K, 3.f), xs(M), y(M * N);
    std::vector<uint8_t> q(M * K4 * 4);
    for (int64_t m = 0; m < M; ++m) xs[m] = d3d::int8::quantize_row(&x[m * K], smooth.data(), K, K4 * 4, &q[m * K4 * 4]);
    d3d::int8::blocks(q.data(), M, K4, w.data(), N, wsum.data(), wsc.data(), xs.data(), bias.data(), y.data(), 0, NB);
    char name[64];
    std::snprintf(name, sizeof name, "int8 %lldx%lldx%lld", static_cast<long long>(M), static_cast<long long>(K),
                  static_cast<long long>(N));
    print(name, y);
    print((std::string(name) + " quantized").c_str(), q);
  }
}

void q4_products() {
  namespace q4 = d3d::q4;
  const int64_t N = 40, K = 300, SB = (K + q4::SUPER - 1) / q4::SUPER, NB = (N + q4::LANES - 1) / q4::LANES;
  std::vector<float> bias = randoms(N);
  for (int64_t bits : {4, 6, 8}) {  // 6 bits: any bytes are nibbles and top bits
    std::vector<uint8_t> wq(NB * ((K + q4::GROUP - 1) / q4::GROUP) * bits * q4::GROUP_BYTES / 4), wsm(NB * SB * q4::SCALES);
    std::vector<float> wdd(NB * SB * q4::FACTORS);
    for (uint8_t& b : wq) b = bits != 8 ? uint8_t(int(next(128.f)) + 128) : uint8_t(int(next(127.f)) + 127);  // 8 bits: q <= 254
    for (uint8_t& b : wsm) b = uint8_t(int(next(32.f)) + 32);
    for (float& f : wdd) f = next(0.01f) + 0.011f;
    for (int64_t M : {1, 3, 4, 7, 9, 14, 21}) {
      std::vector<float> x = randoms(M * K, 3.f), xs(M * SB), y(M * N);
      std::vector<int8_t> q(M * SB * q4::SUPER);
      std::vector<int32_t> xsum(M * SB * q4::GROUPS);
      for (int64_t m = 0; m < M; ++m)
        q4::quantize_row(&x[m * K], K, &q[m * SB * q4::SUPER], &xs[m * SB], &xsum[m * SB * q4::GROUPS]);
      q4::blocks(bits, q.data(), M, K, xs.data(), xsum.data(), wq.data(), wsm.data(), wdd.data(), N, bias.data(),
                 y.data(), 0, NB);
      char name[64];
      std::snprintf(name, sizeof name, "int4 %lld bits %lldx%lldx%lld", static_cast<long long>(bits),
                    static_cast<long long>(M), static_cast<long long>(K), static_cast<long long>(N));
      print(name, y);
      print((std::string(name) + " quantized").c_str(), q);
    }
  }
}

void rows() {
  using namespace d3d::rows;
  for (int64_t D : {64, 128}) {
    const int64_t n = 37;
    std::vector<float> q = randoms(D), k = randoms(n * D), v = randoms(n * D), out(D);
    AttendScratch scratch;
    std::vector<float> cs = randoms(D / 2), sn = randoms(D / 2), w = randoms(D);
    std::vector<float> normed(D);
    rms_norm(q.data(), w.data(), D, 1e-6f, normed.data());
    rope(normed.data(), cs.data(), sn.data(), D);
    const std::string d = "D=" + std::to_string(D);
    print(("norm+rope " + d).c_str(), normed);
    attend_row(normed.data(), k.data(), v.data(), nullptr, n, D, out.data(), scratch);
    print(("attention " + d).c_str(), out);
    bool mask[37];
    for (int64_t j = 0; j < n; ++j) mask[j] = j % 3 != 1;
    attend_row(normed.data(), k.data(), v.data(), mask, n, D, out.data(), scratch);
    print(("masked attention " + d).c_str(), out);
    // 3 rows x 2 heads together (a causal row, a tree row, a row of all the keys) over more keys than one chunk
    // holds, and the same 6 queries one by one: test_kernel_paths checks that the two lines are equal
    const int64_t many = 300, nr = 3, nh = 2;
    std::vector<float> qs = randoms(nr * nh * D), ks = randoms(many * D), vs = randoms(many * D);
    std::vector<float> together(nr * nh * D), alone(nr * nh * D);
    bool tree_row[300];
    for (int64_t j = 0; j < many; ++j) tree_row[j] = j < 250 || j % 7 == 2;
    const bool* masks[nr] = {nullptr, tree_row, nullptr};
    const int64_t n_keys[nr] = {123, many, many};
    attend_rows(qs.data(), nh * D, nr, nh, masks, n_keys, ks.data(), vs.data(), D, together.data(), nh * D, scratch);
    for (int64_t j = 0; j < nr; ++j)
      for (int64_t h = 0; h < nh; ++h)
        attend_row(qs.data() + (j * nh + h) * D, ks.data(), vs.data(), masks[j], n_keys[j], D,
                   alone.data() + (j * nh + h) * D, scratch);
    print(("attention of rows together " + d).c_str(), together);
    print(("attention of rows one by one " + d).c_str(), alone);
  }
  std::vector<float> gate = randoms(333, 9.f), up = randoms(333), a(333);
  silu_mul(gate.data(), up.data(), 333, a.data());
  print("silu", a);
  std::vector<float> wide = randoms(333, 200.f);  // past exp_approx's clamps at -87 and 88 on both sides
  silu_mul(wide.data(), up.data(), 333, a.data());
  print("silu clamped", a);
}

}  // namespace

int main() {
  std::printf("path %s\n", d3d::kernel_path());
  std::printf("int8 %s\n", d3d::int8::int8_path());
  std::printf("int4 %s\n", d3d::q4::q4_path());
  fp32_products();
  int8_products();
  q4_products();
  rows();
}
