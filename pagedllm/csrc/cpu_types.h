// bfloat16 as raw bits, float16 (c10::Half), and the float32 vector loads and e^x every kernel
// shares.
#pragma once

#include <c10/util/Half.h>
#include <torch/types.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// bfloat16 is the upper half of a float32: widening is a shift; narrowing rounds to nearest
// even, NaN to the canonical quiet NaN (c10::BFloat16's rule, so results equal torch's casts).
static inline float bf2f(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t f2bf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline float round_bf(float f) { return bf2f(f2bf(f)); }

// One element of a float32, bfloat16 (uint16_t) or float16 buffer as float32, and back (rounded
// to nearest even), for kernels templated on the element type.
static inline float to_f(float x) { return x; }
static inline float to_f(uint16_t h) { return bf2f(h); }
static inline float to_f(c10::Half h) { return (float)h; }
template <typename T>
static inline T from_f(float f) {
  if constexpr (std::is_same<T, uint16_t>::value)
    return f2bf(f);
  else
    return T(f);
}

static inline const uint16_t* bf_ptr(const torch::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}
static inline uint16_t* bf_mut(torch::Tensor& t) {
  return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
}

// e^f = 1 + f + f^2 / 2 + ... + f^7 / 7!, Horner's coefficients from the highest power: the
// exp512 / exp256 polynomial.
static constexpr float EXP2_POLY[8] = {1.f / 5040, 1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};

#ifdef __AVX512F__
// 16 values -> float32 lanes (a bfloat16 is widened by a shift into the upper half).
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}

// e^x for x <= 0 (scores minus their max): 2^(x log2 e) = 2^n * 2^f, |f| <= 1/2, 2^f by its
// degree-7 Taylor polynomial (relative error ~1e-8, below float rounding).
static inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
  __m512 p = _mm512_set1_ps(EXP2_POLY[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_POLY[i]));
  return _mm512_scalef_ps(p, n);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// The same 8 at a time.
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

// exp512's e^x (x <= 0); 2^n built in the exponent bits (n >= -126 after the clamp).
static inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.6931471805599453f));
  __m256 p = _mm256_set1_ps(EXP2_POLY[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_POLY[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif
