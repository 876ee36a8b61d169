// d3d's CPU kernels: the vector path of this build and one register of fp32 lanes on it. No torch here: the
// kernel headers (fp32_kernel.h, int8_kernel.h, layer_kernel.h) build on their own too, for tests on other
// CPUs (tests/kernel_harness.cpp, also cross-built for aarch64 and run under qemu).
#pragma once
#include <cstdint>

// One vector path per build, chosen by the compiler flags (-march=native, or a path forced by D3D_KERNELS):
// AVX-512, AVX2 + FMA, aarch64 NEON, or plain loops. Every path computes the same sums in the same order,
// so all of them give bitwise the same results (tests/test_kernel_paths.py checks each against the plain
// loops).
#if defined(D3D_SCALAR)  // plain loops whatever the CPU (-DD3D_SCALAR): the reference the others are tested against
#elif defined(__AVX512F__)
#define D3D_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define D3D_AVX2 1
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define D3D_NEON 1
#include <arm_neon.h>
#endif
#if defined(D3D_AVX512) || defined(D3D_AVX2) || defined(D3D_NEON)
#define D3D_VEC 1
#endif

namespace d3d {

// The vector path this build runs: "avx512", "avx2", "neon" or "scalar".
inline const char* kernel_path() {
#if defined(D3D_AVX512)
  return "avx512";
#elif defined(D3D_AVX2)
  return "avx2";
#elif defined(D3D_NEON)
  return "neon";
#else
  return "scalar";
#endif
}

// One register of fp32 lanes on this build's vector path, with the few operations the kernels use; each is
// the same IEEE operation on every lane in every path, so code written over Vec gives the same bits on all.
#ifdef D3D_VEC
// AVX-512 and AVX2 + FMA spell the same operations with another prefix and width.
#define D3D_X86_VEC(P, TYPE, WIDTH)                                          \
  using T = TYPE;                                                           \
  static constexpr int64_t W = WIDTH;                                       \
  static T zero() { return P##_setzero_ps(); }                              \
  static T load(const float* p) { return P##_loadu_ps(p); }                 \
  static void store(float* p, T v) { P##_storeu_ps(p, v); }                 \
  static T set1(float a) { return P##_set1_ps(a); }                         \
  static T add(T a, T b) { return P##_add_ps(a, b); }                       \
  static T mul(T a, T b) { return P##_mul_ps(a, b); }                       \
  static T fma(T a, T b, T c) { return P##_fmadd_ps(a, b, c); }  /* a * b + c, rounded once */   \
  static T sub(T a, T b) { return P##_sub_ps(a, b); }                       \
  static T div(T a, T b) { return P##_div_ps(a, b); }                       \
  static T neg(T a) { return P##_xor_ps(a, P##_set1_ps(-0.f)); }            \
  static T max(T a, T b) { return P##_max_ps(a, b); }  /* a > b ? a : b */  \
  static T min(T a, T b) { return P##_min_ps(a, b); }  /* a < b ? a : b */

struct Vec {
#if defined(D3D_AVX512)
  D3D_X86_VEC(_mm512, __m512, 16)
  // 2^k for whole k in -126..127 (the exponent field k + 127)
  static T pow2i(T k) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(k), _mm512_set1_epi32(127)), 23));
  }
#elif defined(D3D_AVX2)
  D3D_X86_VEC(_mm256, __m256, 8)
  static T pow2i(T k) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(k), _mm256_set1_epi32(127)), 23));
  }
#elif defined(D3D_NEON)
  using T = float32x4_t;
  static constexpr int64_t W = 4;
  static T zero() { return vdupq_n_f32(0.f); }
  static T load(const float* p) { return vld1q_f32(p); }
  static void store(float* p, T v) { vst1q_f32(p, v); }
  static T set1(float a) { return vdupq_n_f32(a); }
  static T add(T a, T b) { return vaddq_f32(a, b); }
  static T mul(T a, T b) { return vmulq_f32(a, b); }
  static T fma(T a, T b, T c) { return vfmaq_f32(c, a, b); }
  static T sub(T a, T b) { return vsubq_f32(a, b); }
  static T div(T a, T b) { return vdivq_f32(a, b); }
  static T neg(T a) { return vnegq_f32(a); }
  static T max(T a, T b) { return vmaxq_f32(a, b); }
  static T min(T a, T b) { return vminq_f32(a, b); }
  static T pow2i(T k) { return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(k), vdupq_n_s32(127)), 23)); }
#endif
};
#endif

}  // namespace d3d
