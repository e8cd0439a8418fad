// The float32 vector of this build, for kernels written once for every ISA level (csrc/build.py
// VARIANTS): 16 lanes (AVX-512), 8 (AVX2 + FMA + F16C), or 1 (portable). CPU_VEC_SIMD is
// defined where the vector is a register of several lanes.
#pragma once

#include <cmath>
#include <cstdint>

#include "cpu_types.h"
#include "kv_quant.h"  // load16 / load8 of the quantized elements, before vload's template

#if defined(__AVX512F__)
#define CPU_VEC_SIMD 1
constexpr int VL = 16;
using vec = __m512;
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vset(float x) { return _mm512_set1_ps(x); }
static inline vec vld(const float* p) { return _mm512_loadu_ps(p); }
static inline void vst(float* p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline vec vexp(vec x) { return exp512(x); }
static inline float vreduce(vec v) { return _mm512_reduce_add_ps(v); }
// v's first m lanes (0 < m <= VL) to p; the memory past them is not touched.
static inline void vst_first(float* p, vec v, int64_t m) {
  _mm512_mask_storeu_ps(p, (__mmask16)((1u << m) - 1), v);
}
// v[i]'s 16 lanes summed, for i < 16 -> lane i: unpack and shuffle pairs, 45 instructions for
// 16 sums where one reduction each costs ~8.
static inline vec vsum_lanes(const vec* v) {
  __m512 u[4];
  for (int i = 0; i < 4; ++i) {
    const __m512 *x = v + 4 * i, *y = x + 1, *z = x + 2, *w = x + 3;
    // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] and the same of z, w
    const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(*x, *y), _mm512_unpackhi_ps(*x, *y));
    const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(*z, *w), _mm512_unpackhi_ps(*z, *w));
    // per 128-bit lane: [x, y, z, w] of that lane
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // 128-bit lane k of the result: u[k]'s four lanes added
  const __m512 s01 =
      _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 s23 =
      _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}
template <typename T>
static inline vec vload(const T* p) {
  return load16(p);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CPU_VEC_SIMD 1
constexpr int VL = 8;
using vec = __m256;
static inline vec vzero() { return _mm256_setzero_ps(); }
static inline vec vset(float x) { return _mm256_set1_ps(x); }
static inline vec vld(const float* p) { return _mm256_loadu_ps(p); }
static inline void vst(float* p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline vec vexp(vec x) { return exp256(x); }
static inline float vreduce(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline void vst_first(float* p, vec v, int64_t m) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)m), lane), v);
}
// Each 128-bit half of x, y, z, w summed within the half -> that half of the result holds
// [x's sum, y's, z's, w's]: 9 instructions.
static inline vec vsum_lanes4(vec x, vec y, vec z, vec w) {
  const __m256 a = _mm256_add_ps(_mm256_unpacklo_ps(x, y), _mm256_unpackhi_ps(x, y));
  const __m256 b = _mm256_add_ps(_mm256_unpacklo_ps(z, w), _mm256_unpackhi_ps(z, w));
  return _mm256_add_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}
// vsum_lanes4 of rows 0-3 (u0) and of rows 4-7 (u1) -> row i's sum in lane i: the low halves
// added (rows 0-3), then the high ones (rows 4-7).
static inline vec vsum_halves(vec u0, vec u1) {
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
// v[i]'s 8 lanes summed, for i < 8 -> lane i (vsum_lanes of AVX-512, on 8 lanes).
static inline vec vsum_lanes(const vec* v) {
  return vsum_halves(vsum_lanes4(v[0], v[1], v[2], v[3]), vsum_lanes4(v[4], v[5], v[6], v[7]));
}
template <typename T>
static inline vec vload(const T* p) {
  return load8(p);
}
#else
constexpr int VL = 1;
using vec = float;
static inline vec vzero() { return 0.f; }
static inline vec vset(float x) { return x; }
static inline vec vld(const float* p) { return *p; }
static inline void vst(float* p, vec v) { *p = v; }
static inline vec vfma(vec a, vec b, vec c) { return a * b + c; }
static inline vec vmul(vec a, vec b) { return a * b; }
static inline vec vadd(vec a, vec b) { return a + b; }
static inline vec vsub(vec a, vec b) { return a - b; }
static inline vec vmax(vec a, vec b) { return a > b ? a : b; }
static inline vec vexp(vec x) { return std::exp(x); }
static inline float vreduce(vec v) { return v; }
static inline void vst_first(float* p, vec v, int64_t) { *p = v; }
static inline vec vsum_lanes(const vec* v) { return *v; }
template <typename T>
static inline vec vload(const T* p) {
  return to_f(*p);
}
#endif
