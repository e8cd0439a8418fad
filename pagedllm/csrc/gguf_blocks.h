// What gguf_linear.cpp (int16 activations, codes in pairs) and gguf_int8.cpp (int8 activations,
// codes in quads) share: the GGML type numbers, a group's super-block sizes (equal in both
// layouts: only the order of the codes differs), the float SIMD helpers, the output of a tile.
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace gguf {

// GGML type numbers (gguf.GGMLQuantizationType).
enum : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
// Added to a group's type in `meta`: its codes are in quads (the int8 activations' layout).
constexpr int64_t QUADS = 256;
constexpr int GROUP = 16;  // weight rows a group
constexpr int QB = 32;     // features a block (an activation scale)
constexpr int TILE = 8;    // activation rows a tile

// Bytes of one super-block of a group, and its features (either layout).
constexpr int64_t superblock_bytes(int64_t type) {
  switch (type % QUADS) {
    case Q4_0: return 32 + 256;
    case Q4_1: return 64 + 256;
    case Q5_0: return 32 + 256 + 64;
    case Q5_1: return 64 + 256 + 64;
    case Q5_K: return 64 + 256 + 8 * 256 + 8 * 64;
    case Q8_0: return 32 + 512;
    case Q4_K: return 64 + 256 + 8 * 256;
    case Q6_K: return 32 + 256 + 8 * 256 + 8 * 128;
  }
  TORCH_CHECK(false, "GGUF type ", type, " has no kernel (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)");
  return 0;
}
inline bool is_kquant(int64_t type) {
  const int64_t t = type % QUADS;
  return t == Q4_K || t == Q5_K || t == Q6_K;
}
inline int64_t superblock_features(int64_t type) { return is_kquant(type) ? 256 : 32; }

inline float h2f(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

#if (defined(__AVX512F__) && defined(__AVX512VNNI__)) || defined(__AVX2__)
#define GGUF_SIMD 1
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
constexpr int L = 16;  // weight rows a vector
using VF = __m512;
inline VF f16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline VF u8f(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
inline VF s8f(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
inline VF cvt(__m512i v) { return _mm512_cvtepi32_ps(v); }
inline VF set1(float f) { return _mm512_set1_ps(f); }
inline VF zero_f() { return _mm512_setzero_ps(); }
inline VF mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF fma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline void store(float* p, VF v) { _mm512_storeu_ps(p, v); }
inline VF loadf(const float* p) { return _mm512_loadu_ps(p); }
inline VF addf(VF a, VF b) { return _mm512_add_ps(a, b); }
#else
constexpr int L = 8;
using VF = __m256;
inline VF f16(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline VF u8f(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline VF s8f(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline VF cvt(__m256i v) { return _mm256_cvtepi32_ps(v); }
inline VF set1(float f) { return _mm256_set1_ps(f); }
inline VF zero_f() { return _mm256_setzero_ps(); }
inline VF mul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF fma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline void store(float* p, VF v) { _mm256_storeu_ps(p, v); }
inline VF loadf(const float* p) { return _mm256_loadu_ps(p); }
inline VF addf(VF a, VF b) { return _mm256_add_ps(a, b); }
#endif

// y[M] (the sums of activation rows t0.. with the L weight rows from row0 + h L) into out [T, N],
// the first n of each vector, plus the bias. A whole vector (every group but a weight's last) is
// one store a row: the scalar copy was ~3 % of a Q8_0 group's time at K = 2048.
template <int M>
inline void write_tile(const VF* y, int64_t t0, int64_t row0, int h, int n, const float* bias, float* out,
                       int64_t N) {
  const int64_t c0 = row0 + h * L;
  if (n == L) {
    const VF b = bias ? loadf(bias + c0) : zero_f();
    for (int r = 0; r < M; ++r) store(out + (t0 + r) * N + c0, addf(y[r], b));
    return;
  }
  alignas(64) float t[L];
  for (int r = 0; r < M; ++r) {
    float* o = out + (t0 + r) * N + c0;
    store(t, y[r]);
    for (int i = 0; i < n; ++i) o[i] = t[i] + (bias ? bias[c0 + i] : 0.f);
  }
}
#endif

// Calls tile<M>(t0) for the activation rows [t_begin, T) in tiles of at most TILE rows.
template <template <int> class F, class... Args>
inline void over_tiles(int64_t t_begin, int64_t T, Args&&... args) {
  for (int64_t t0 = t_begin; t0 < T; t0 += TILE) {
    switch (std::min<int64_t>(TILE, T - t0)) {
      case 1: F<1>::run(t0, args...); break;
      case 2: F<2>::run(t0, args...); break;
      case 3: F<3>::run(t0, args...); break;
      case 4: F<4>::run(t0, args...); break;
      case 5: F<5>::run(t0, args...); break;
      case 6: F<6>::run(t0, args...); break;
      case 7: F<7>::run(t0, args...); break;
      default: F<8>::run(t0, args...); break;
    }
  }
}

// The int8 activations of T rows (gguf_int8.cpp): codes with one step d = amax / 127 per `span`
// features (32: as llama.cpp's Q8_0; 256: as its Q8_K, when a K-quant group takes them, so that
// a super-block's integer sums add up before one float scaling), each block of 32's step (the
// span's, repeated), the integer sums of each 16 codes (|sum| <= 16 x 127: int16, so that a
// block's two are one int32 pair for vpmaddwd / vpdpwssd). The codes, the steps and the blocks'
// sums are laid out by tiles of TILE rows, each tile's block-major (`at`): a tile's kernel walks
// them with one pointer and constant offsets a row (16 general registers did not hold a pointer
// a row for each of them: GCC kept the codes' pointers in vector registers, or reloaded them).
struct Acts8 {
  int8_t* q;     // [T, K] at `at` x 32: block b of row t is the 32 bytes from at(t, b) QB
  float* d;      // [T, K/32] at `at`
  float* e;      // [T, K/32] at `at`: d times the block's sum of 32 codes (the mins' term)
  int32_t* s;    // [T, K/32] at `at`: the block's sum of 32 codes (the codes' offsets' term)
  int16_t* sum;  // [T, K/16]
  int64_t K;
  int64_t span;  // features a step: 32 or 256
  int64_t T;
  // Where row t's block b is in d, e and s: rows t0.. of the tile [t0, t0 + n) (n = TILE, the last
  // tile's fewer) at t0 K/32 + b n + (t - t0).
  int64_t at(int64_t t, int64_t b) const {
    const int64_t t0 = t - t % TILE;
    return t0 * (K / QB) + b * std::min<int64_t>(TILE, T - t0) + (t - t0);
  }
  float step(int64_t t, int64_t b) const { return d[at(t, b)]; }
  int code(int64_t t, int64_t k) const { return q[at(t, k / QB) * QB + k % QB]; }
};
// Needs acts8_bytes(T, K) at buf; span 32 or 256 (K a multiple of it).
Acts8 quantize_acts8(const float* x, int64_t T, int64_t K, int64_t span, uint8_t* buf);
// The same in two steps: the layout of T rows at buf, then rows [t0, t1) from x_rows [t1 - t0, K]
// (a decode step's rows quantized by different threads).
Acts8 acts8_at(uint8_t* buf, int64_t T, int64_t K, int64_t span);
void quantize_acts8_rows(const float* x_rows, const Acts8& a, int64_t t0, int64_t t1);
inline int64_t acts8_bytes(int64_t T, int64_t K) { return T * K + 12 * (T * K / QB) + 2 * (T * K / 16); }
// Output rows [row0, row0 + rows) of one quads group g for activation rows [t_begin, T).
void run_group8(const uint8_t* g, int64_t type, const Acts8& a, int64_t t_begin, int64_t T, int64_t row0,
                int rows, const float* bias, float* out, int64_t N);

// Row `row` of a group as float32 (w = code s + m), K features (either layout).
void dequantize_group_row(const uint8_t* g, int64_t type, int64_t K, int row, float* out);

// No SIMD: each row dequantised, then float dot products with the activations' codes (int16
// or int8: `Activations` has K, code(t, k) and step(t, b), block b's) -> rows [row0, row0 + rows).
template <class Activations>
void run_group_scalar(const uint8_t* g, int64_t type, const Activations& a, int64_t t_begin, int64_t T,
                      int64_t row0, int rows, const float* bias, float* out, int64_t N) {
  const int64_t K = a.K;
  std::vector<float> w(K);
  for (int i = 0; i < rows; ++i) {
    dequantize_group_row(g, type, K, i, w.data());
    for (int64_t t = t_begin; t < T; ++t) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += w[k] * a.code(t, k) * a.step(t, k / QB);
      out[t * N + row0 + i] = acc + (bias ? bias[row0 + i] : 0.f);
    }
  }
}

}  // namespace gguf
