// The quantized KV cache's elements (attention/kv_quant.py): int8, and fp8 e4m3 / e5m2 held as
// bytes, each read as float32 (the per-token scale is applied by the kernel, not here).
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

struct Fp8E4M3 {
  uint8_t bits;
};
struct Fp8E5M2 {
  uint8_t bits;
};

template <typename C>
constexpr bool is_quantized_kv() {
  return std::is_same<C, int8_t>::value || std::is_same<C, Fp8E4M3>::value || std::is_same<C, Fp8E5M2>::value;
}

// e5m2 is the upper byte of a float16. e4m3's sign, exponent and mantissa bits moved into a
// float16's (shifted left 7) give its value times 2^-8 exactly, subnormals included (the
// exponent biases are 7 and 15); its NaN (S.1111.111) is never written (values are clamped to 448).
static inline float to_f(int8_t x) { return (float)x; }
static inline float to_f(Fp8E5M2 x) { return c10::detail::fp16_ieee_to_fp32_value((uint16_t)(x.bits << 8)); }
static inline float to_f(Fp8E4M3 x) {
  const uint16_t h = (uint16_t)(((x.bits & 0x80) << 8) | ((x.bits & 0x7f) << 7));
  return c10::detail::fp16_ieee_to_fp32_value(h) * 256.f;
}

#ifdef __AVX512F__
static inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
static inline __m512 load16(const Fp8E5M2* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
  return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
}
static inline __m512 load16(const Fp8E4M3* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}
#elif defined(__AVX2__) && defined(__F16C__)
// The same 8 at a time.
static inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
static inline __m256 load8(const Fp8E5M2* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)p));
  return _mm256_cvtph_ps(_mm_slli_epi16(b, 8));
}
static inline __m256 load8(const Fp8E4M3* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)p));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
}
#endif
