// bfloat16 as raw bits and the float32 vector loads every kernel shares.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <cstring>
#ifdef __AVX512F__
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

// One element of a float32 or bfloat16 (uint16_t) buffer as float32, for kernels templated
// on the element type.
static inline float to_f(float x) { return x; }
static inline float to_f(uint16_t h) { return bf2f(h); }

static inline const uint16_t* bf_ptr(const torch::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}
static inline uint16_t* bf_mut(torch::Tensor& t) {
  return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
}

#ifdef __AVX512F__
// 16 values -> float32 lanes (a bfloat16 is widened by a shift into the upper half).
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
#endif
