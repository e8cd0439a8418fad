// bfloat16 pairs for vdpbf16ps (AVX512-BF16), which multiplies the two bfloat16 halves of each
// 32-bit lane of one register by those of another, exactly, and adds both products into a
// float32 lane. A weighted sum of value rows, out[d] += p0 v0[d] + p1 v1[d], takes the pair
// (p0, p1) broadcast against the rows' pairs (v0[d], v1[d]) of 16 columns: one instruction for
// two keys and 16 columns, where widening to float32 takes two loads, two widenings, two FMAs.
#pragma once

#include <cstdint>

#include "cpu_types.h"

#ifdef __AVX512BF16__
// Columns [0, 16) and [16, 32) of rows a and b (32 bfloat16 each) as pairs (a[d], b[d]).
static inline void bf16_pairs(const uint16_t* a, const uint16_t* b, __m512i& lo, __m512i& hi) {
  const __m512i idx_lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                          38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i idx_hi = _mm512_add_epi16(idx_lo, _mm512_set1_epi16(16));
  const __m512i va = _mm512_loadu_si512(a), vb = _mm512_loadu_si512(b);
  lo = _mm512_permutex2var_epi16(va, idx_lo, vb);
  hi = _mm512_permutex2var_epi16(va, idx_hi, vb);
}

// Rows a and b of D bfloat16 values (D a multiple of 32) -> dst [D] pairs (a[d], b[d]).
static inline void bf16_pair_rows(const uint16_t* a, const uint16_t* b, int64_t D, uint32_t* dst) {
  for (int64_t d = 0; d < D; d += 32) {
    __m512i lo, hi;
    bf16_pairs(a + d, b + d, lo, hi);
    _mm512_storeu_si512(dst + d, lo);
    _mm512_storeu_si512(dst + d + 16, hi);
  }
}

// 16 lanes of x and y (float32) rounded to bfloat16 (to nearest even) as pairs (x[i], y[i]).
static inline __m512i bf16_pack_pairs(__m512 x, __m512 y) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                       22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(y, x));
}
#endif
