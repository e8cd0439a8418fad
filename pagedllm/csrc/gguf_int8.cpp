// GGUF linears with int8 activations (gguf_linear.cpp's header: the layouts and the dispatch):
// the weight codes as unsigned bytes against the int8 activations, 4 products a 32-bit lane.
//
// Codes in quads: for each 32-feature block a group's codes are chunks of 64 bytes, byte 4i + j
// of a chunk = row i, feature 4q + j (q the chunk's quad). One vpdpbusd (AVX-512 VNNI: u8 x s8)
// with the quad of int8 activations broadcast adds 4 products to each of 16 rows' int32 sums;
// AVX2: the chunk's half of 8 rows, maddubs (u8 x s8 -> int16 pairs) then madd by ones, a pass
// of 4 activation rows over both halves (16 vector registers). Codes are unpacked on bytes, 64 a
// vector. 4-bit: chunk c (0..3) holds quad c in its low nibbles, quad c + 4
// in its high ones; 8-bit: chunk q holds quad q; 5-bit high bits: one chunk, bit q for quad q;
// Q6_K: 6 chunks, half-block h's quads 4h..4h+3 (one sub-scale) in chunks 3h..3h+2: chunk 3h + i
// holds quad 4h + i in bits 0-5 and bits 2i..2i+1 of quad 4h + 3 in bits 6-7 (three quads one
// `and` each, the fourth q6_fourth; the pairs' 4 + 2 bits took 19 ops a 4 quads on AVX2, 11).
//
// Exact int32 sums: |code| <= 255, |x| <= 127, 32 products. AVX2's int16 pairs: codes <= 63
// (two maddubs summed: 2 x 2 x 63 x 127 < 32768 before the madd), 4-bit codes a whole block's
// (8 x 2 x 15 x 127 < 32768); Q8_0's signed codes one at a
// time as |w| times x with w's sign (2 x 128 x 127 < 32768). AVX-512 takes Q8_0's codes + 128
// (a xor). The codes' offsets (Q8_0's 128 there, Q4_0's 8, Q5_0's 16) are taken off in the int32
// sums, as -off Σx (Acts8::s; |sum| < 2^31); the mins (Q4_1 / Q5_1's m) in float, as m times
// the block's dx Σx (Acts8::e; each sum < 2^24, so its float is exact); Q6_K's 32 and Q4_K /
// Q5_K's dmin mn with the integer sums.
//
// K-quants take activations with one step a super-block of 256 (Acts8::span, as llama.cpp's
// Q8_K): a block's int32 sum times the block's integer sub-scale (vpmulld; AVX2's Q4_K and
// Q6_K: the vpmaddwd that widens their int16 sums) adds up over the super-block, and the float
// scaling is once a super-block instead of once a block (Q6_K: two).
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "gguf_blocks.h"

namespace gguf {

Acts8 acts8_at(uint8_t* buf, int64_t T, int64_t K, int64_t span) {
  TORCH_CHECK((span == QB || span == 256) && K % span == 0, "int8 activations: span ", span, " for K ", K);
  const int64_t B = T * K / QB;  // blocks
  return Acts8{reinterpret_cast<int8_t*>(buf),
               reinterpret_cast<float*>(buf + T * K),
               reinterpret_cast<float*>(buf + T * K + 4 * B),
               reinterpret_cast<int32_t*>(buf + T * K + 8 * B),
               reinterpret_cast<int16_t*>(buf + T * K + 12 * B),
               K,
               span,
               T};
}

Acts8 quantize_acts8(const float* x, int64_t T, int64_t K, int64_t span, uint8_t* buf) {
  const Acts8 a = acts8_at(buf, T, K, span);
  quantize_acts8_rows(x, a, 0, T);
  return a;
}

// The largest |x| of n floats (n a multiple of L), NaN ignored (as std::max(amax, |x|)), and 16
// codes round(x inv) (|x inv| <= 127, rounded to even as std::nearbyint) stored at q, returning
// their sum: in vectors, the same codes as the scalar loops (GCC's code for those read each
// stored byte back: ~0.3 ns an activation, ~1 ms of a 16-row decode step of the 1B shape).
#ifdef GGUF_SIMD
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
inline float amax_of(const float* x, int64_t n) {
  VF m = zero_f();
  for (int64_t i = 0; i < n; i += L) m = _mm512_max_ps(_mm512_abs_ps(loadf(x + i)), m);
  return _mm512_reduce_max_ps(m);
}
inline int32_t codes16(const float* x, float inv, int8_t* q) {
  const __m512i c = _mm512_cvtps_epi32(mul(loadf(x), set1(inv)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(c));
  return _mm512_reduce_add_epi32(c);
}
#else
inline float amax_of(const float* x, int64_t n) {
  VF m = zero_f();
  for (int64_t i = 0; i < n; i += L) m = _mm256_max_ps(_mm256_andnot_ps(set1(-0.f), loadf(x + i)), m);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}
inline int32_t codes16(const float* x, float inv, int8_t* q) {
  const __m256i a = _mm256_cvtps_epi32(mul(loadf(x), set1(inv))),
                b = _mm256_cvtps_epi32(mul(loadf(x + 8), set1(inv)));
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);  // 16 int16 in order
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q),
                   _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
  const __m256i s = _mm256_add_epi32(a, b);
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
}
#endif
#else
inline float amax_of(const float* x, int64_t n) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  return amax;
}
inline int32_t codes16(const float* x, float inv, int8_t* q) {
  int32_t s = 0;
  for (int i = 0; i < 16; ++i) s += q[i] = (int8_t)std::nearbyint(x[i] * inv);
  return s;
}
#endif

void quantize_acts8_rows(const float* x_rows, const Acts8& a, int64_t t0, int64_t t1) {
  const int64_t off = t0 * a.K, span = a.span, KB = a.K / QB;  // x_rows[i]: feature off + i of [T, K]
  at::parallel_for(off / span, t1 * a.K / span, 32, [&](int64_t c0, int64_t c1) {
    for (int64_t s = c0; s < c1; ++s) {
      const float* xs = x_rows + (s * span - off);
      const float amax = amax_of(xs, span);
      const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
      for (int64_t b = s * span / QB; b < (s + 1) * span / QB; ++b) {
        const float* xb = x_rows + (b * QB - off);
        const int64_t at = a.at(b / KB, b % KB);
        int8_t* q = a.q + at * QB;
        const int32_t s0 = codes16(xb, inv, q), s1 = codes16(xb + 16, inv, q + 16);
        a.d[at] = d, a.e[at] = d * (float)(s0 + s1), a.s[at] = s0 + s1;
        a.sum[2 * b] = (int16_t)s0, a.sum[2 * b + 1] = (int16_t)s1;
      }
    }
  });
}

#ifdef GGUF_SIMD
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
using VI = __m512i;
inline VI load(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline VI and_(VI v, int8_t m) { return _mm512_and_si512(v, _mm512_set1_epi8(m)); }
inline VI srl(VI v, int n) { return _mm512_srli_epi16(v, n); }
inline VI sll(VI v, int n) { return _mm512_slli_epi16(v, n); }
// Bits 0-3 of a, 4-7 of b (one vpternlogd: a bitwise select by 0x0f).
inline VI low_high(VI a, VI b) { return _mm512_ternarylogic_epi32(_mm512_set1_epi8(15), a, b, 0xCA); }
// Q6_K's fourth quad of a half-block from the bits 6-7 of its three chunks (bits 0-1 of a, 2-3
// of b, 4-5 of c): two bitwise selects of the shifted chunks, then the 6 bits.
inline VI q6_fourth(VI a, VI b, VI c) {
  const VI ab = _mm512_ternarylogic_epi32(_mm512_set1_epi8(3), srl(a, 6), srl(b, 4), 0xCA);
  return and_(_mm512_ternarylogic_epi32(_mm512_set1_epi8(15), ab, srl(c, 2), 0xCA), 63);
}
inline VI zero_i() { return _mm512_setzero_si512(); }
inline VI set1i(int32_t v) { return _mm512_set1_epi32(v); }
constexpr bool INT16_U4 = false;  // dot2_u4's sums are int32
inline VI sub(VI a, int32_t b) { return _mm512_sub_epi32(a, _mm512_set1_epi32(b)); }
// acc + the products of (unsigned codes w0, quad x0) and (w1, x1): codes <= 63.
inline VI dot2(VI acc, VI w0, int32_t x0, VI w1, int32_t x1) {
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, w0, _mm512_set1_epi32(x0)), w1, _mm512_set1_epi32(x1));
}
// acc + the products of signed codes w and quad x, plus 128 Σx (SIGNED_OFFSET).
inline VI dot_signed(VI acc, VI w, int32_t x) {
  return _mm512_dpbusd_epi32(acc, _mm512_xor_si512(w, _mm512_set1_epi8(-128)), _mm512_set1_epi32(x));
}
constexpr int SIGNED_OFFSET = 128;
// 4-bit codes: the int32 sums themselves (widen16 is none; a K-quant's sub-scale one vpmulld).
inline VI dot2_u4(VI acc, VI w0, int32_t x0, VI w1, int32_t x1) { return dot2(acc, w0, x0, w1, x1); }
inline VI widen16(VI acc) { return acc; }
inline VI sub_scale(VI sc) { return sc; }
inline VI times_sub_scale(VI acc, VI sc) { return _mm512_mullo_epi32(acc, sc); }
// acc + the int16 pairs of a times the pair at x (2 products a lane).
inline VI dotw(VI acc, VI a, const int32_t* x) { return _mm512_dpwssd_epi32(acc, a, _mm512_set1_epi32(*x)); }
// Lanes a (< 2^15) as the low int16 of each pair, b as the high.
inline VI pair16(VI a, VI b) { return _mm512_mask_blend_epi16(0xAAAAAAAA, a, _mm512_slli_epi32(b, 16)); }
inline VI add(VI a, VI b) { return _mm512_add_epi32(a, b); }
inline VI mullo(VI a, VI b) { return _mm512_mullo_epi32(a, b); }
// acc + a half-block's products (4 quads w of codes <= 63 against the row's quads x) times its
// sub-scale sc (sub_scale's lanes): the int32 sum's vpmulld.
inline VI dot4_scaled(VI acc, const VI* w, const int32_t* x, VI sc) {
  return add(acc, times_sub_scale(dot2(dot2(zero_i(), w[0], x[0], w[1], x[1]), w[2], x[2], w[3], x[3]), sc));
}
inline VI u8i(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
inline VI s8i(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
#else
using VI = __m256i;
inline VI load(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline VI and_(VI v, int8_t m) { return _mm256_and_si256(v, _mm256_set1_epi8(m)); }
inline VI srl(VI v, int n) { return _mm256_srli_epi16(v, n); }
inline VI sll(VI v, int n) { return _mm256_slli_epi16(v, n); }
inline VI low_high(VI a, VI b) {
  const VI m = _mm256_set1_epi8(15);
  return _mm256_or_si256(_mm256_and_si256(a, m), _mm256_andnot_si256(m, b));
}
// Each chunk's bits 6-7 masked before its 16-bit shift, so that no bit crosses into the byte below.
inline VI q6_fourth(VI a, VI b, VI c) {
  const VI m = _mm256_set1_epi8((char)0xC0);
  return _mm256_or_si256(_mm256_or_si256(srl(_mm256_and_si256(a, m), 6), srl(_mm256_and_si256(b, m), 4)),
                         srl(_mm256_and_si256(c, m), 2));
}
inline VI zero_i() { return _mm256_setzero_si256(); }
inline VI set1i(int32_t v) { return _mm256_set1_epi32(v); }
inline VI sub(VI a, int32_t b) { return _mm256_sub_epi32(a, _mm256_set1_epi32(b)); }
// The products of (unsigned codes w0, quad x0) and (w1, x1) as int16 pairs (the callers bound
// them below 2^15).
inline VI products16(VI w0, int32_t x0, VI w1, int32_t x1) {
  return _mm256_add_epi16(_mm256_maddubs_epi16(w0, _mm256_set1_epi32(x0)),
                          _mm256_maddubs_epi16(w1, _mm256_set1_epi32(x1)));
}
inline VI dot2(VI acc, VI w0, int32_t x0, VI w1, int32_t x1) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(products16(w0, x0, w1, x1), _mm256_set1_epi16(1)));
}
inline VI dot_signed(VI acc, VI w, int32_t x) {
  const VI p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(_mm256_set1_epi32(x), w));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
constexpr int SIGNED_OFFSET = 0;
constexpr bool INT16_U4 = true;  // dot2_u4's sums are int16 (widen16 makes them int32)
// 4-bit codes: a block's products add up in int16 (8 x 2 x 15 x 127 < 2^15), one vpmaddwd (widen16)
// a block instead of one a chunk. The empty asm keeps each row's chain in order: GCC made a tree
// of a tile's vpaddw and spilled it.
inline VI dot2_u4(VI acc16, VI w0, int32_t x0, VI w1, int32_t x1) {
  VI s = _mm256_add_epi16(acc16, products16(w0, x0, w1, x1));
  asm("" : "+x"(s));
  return s;
}
inline VI widen16(VI acc16) { return _mm256_madd_epi16(acc16, _mm256_set1_epi16(1)); }
// A K-quant block's int16 sums times its sub-scales (0..63 a lane) in the vpmaddwd that widens
// them (instead of a vpmulld after it): sub_scale puts each lane's in both of its int16 halves.
inline VI sub_scale(VI sc) { return _mm256_blend_epi16(sc, _mm256_slli_epi32(sc, 16), 0xAA); }
inline VI times_sub_scale(VI acc16, VI sc) { return _mm256_madd_epi16(acc16, sc); }
inline VI dotw(VI acc, VI a, const int32_t* x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, _mm256_set1_epi32(*x)));
}
inline VI pair16(VI a, VI b) { return _mm256_blend_epi16(a, _mm256_slli_epi32(b, 16), 0xAA); }
inline VI add(VI a, VI b) { return _mm256_add_epi32(a, b); }
inline VI mullo(VI a, VI b) { return _mm256_mullo_epi32(a, b); }
// Each pair of quads' int16 sums (2 x 2 x 63 x 127 < 2^15) times sc in the vpmaddwd that widens
// them: no vpmulld, and no int32 sum to keep a half-block (Q6_K 1.01-1.07x at 1-16 rows).
inline VI dot4_scaled(VI acc, const VI* w, const int32_t* x, VI sc) {
  return add(acc, add(times_sub_scale(products16(w[0], x[0], w[1], x[1]), sc),
                      times_sub_scale(products16(w[2], x[2], w[3], x[3]), sc)));
}
inline VI u8i(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
inline VI s8i(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
#endif

// The weight stream ahead into L2 (T1: into L1 the requests queue on its few miss buffers).
// The hardware prefetchers lose the stream where a super-block reads two regions at once (the
// 5-bit and 6-bit types' codes and high bits: those loads were most of Q5_K's time). An asm
// prefetch: GCC 12 -O3 drops _mm_prefetch in these loops.
constexpr int64_t PREFETCH_AHEAD = 4096;  // bytes
inline void prefetch_l2(const uint8_t* p) { asm volatile("prefetcht1 %0" : : "m"(*p)); }
inline void prefetch_bytes(const uint8_t* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) prefetch_l2(p + i);
}
// What a pass over a group prefetches: the first streams the group, PREFETCH_AHEAD ahead; a
// second reads it from the cache, so it fetches the NEXT group's super-block meanwhile (the
// memory was idle for half the time; a prefetch past the weight's end does not fault); the
// others nothing.
enum class Fetch { AHEAD, NEXT, NONE };
// Where super-block p of a group of gb bytes prefetches from (null: nothing).
inline const uint8_t* fetch_at(const uint8_t* p, int64_t gb, Fetch f) {
  return f == Fetch::AHEAD ? p + PREFETCH_AHEAD : f == Fetch::NEXT ? p + gb : nullptr;
}
// Its sb bytes at once (the K-quants spread them over the blocks: kquant_superblock).
inline void prefetch_for(const uint8_t* p, int64_t sb, int64_t gb, Fetch f) {
  if (const uint8_t* pf = fetch_at(p, gb, f)) prefetch_bytes(pf, sb);
}

constexpr int CHUNK = 64;    // bytes of a chunk (16 rows x 4 features)
constexpr int HALF = 4 * L;  // bytes of a chunk's vector (L rows; AVX2: a group's half)

// One block of 4-bit codes (4 chunks at `c`) added into M rows' sums, for H vectors of weight
// rows (acc [H, M]; AVX2: both halves of a group take each row's broadcasts), as dot2_u4 adds
// them (AVX2: int16 from zero, widen16 or times_sub_scale to int32).
template <int M, int H = 1>
inline void dot_u4(const uint8_t* c, const int32_t* const* xq, VI* acc) {
  for (int k = 0; k < 4; ++k) {
    VI lo[H], hi[H];
    for (int h = 0; h < H; ++h) {
      const VI v = load(c + k * CHUNK + h * HALF);
      lo[h] = and_(v, 15), hi[h] = and_(srl(v, 4), 15);
    }
    for (int r = 0; r < M; ++r)
      for (int h = 0; h < H; ++h)
        acc[h * M + r] = dot2_u4(acc[h * M + r], lo[h], xq[r][k], hi[h], xq[r][k + 4]);
  }
}

// One block of 5-bit codes added into M rows' int32 sums: the 4-bit chunks `c`, the chunk of
// high bits `hb` (bit q: quad q).
template <int M, int H = 1>
inline void dot_u5(const uint8_t* c, const uint8_t* hb, const int32_t* const* xq, VI* acc) {
  for (int k = 0; k < 4; ++k) {
    VI lo[H], hi[H];
    for (int h = 0; h < H; ++h) {
      const VI v = load(c + k * CHUNK + h * HALF), b = load(hb + h * HALF);
      lo[h] = low_high(v, and_(sll(b, 4 - k), 0x10)), hi[h] = low_high(srl(v, 4), and_(srl(b, k), 0x10));
    }
    for (int r = 0; r < M; ++r)
      for (int h = 0; h < H; ++h) acc[h * M + r] = dot2(acc[h * M + r], lo[h], xq[r][k], hi[h], xq[r][k + 4]);
  }
}

// One Q6_K block (6 chunks at c) into M rows' sums: quads 0-3 (features 0-15) times sub-scale
// sc0, 4-7 times sc1 (sub_scale's lanes); each half-block's first three quads one `and` each,
// the fourth q6_fourth.
template <int M>
inline void dot_q6(const uint8_t* c, const int32_t* const* xq, VI sc0, VI sc1, VI* isum) {
  for (int h = 0; h < 2; ++h) {
    const VI a = load(c + 3 * h * CHUNK), b = load(c + (3 * h + 1) * CHUNK),
             cc = load(c + (3 * h + 2) * CHUNK);
    const VI q[4] = {and_(a, 63), and_(b, 63), and_(cc, 63), q6_fourth(a, b, cc)};
    for (int r = 0; r < M; ++r) isum[r] = dot4_scaled(isum[r], q, xq[r] + 4 * h, h ? sc1 : sc0);
  }
}

// M rows of activations from t0 (inside one of Acts8's tiles), walked with one pointer a field:
// block b's codes, steps, step-times-sums and sums at + b stride (codes: times 32), row r at + r
// (the loops' stores of float vectors may alias Acts8's fields, so the compiler reloaded them
// and redid the index arithmetic for every row of every block).
template <int M>
struct Rows8 {
  const int8_t* q;
  const int16_t* sum[M];  // each row's integer sums of 16 codes (the K-quants' mins and offsets)
  const float* d;
  const float* e;
  const int32_t* s;
  int64_t stride, K;
  Rows8(const Acts8& a, int64_t t0)
      : q(a.q + a.at(t0, 0) * QB),
        d(a.d + a.at(t0, 0)),
        e(a.e + a.at(t0, 0)),
        s(a.s + a.at(t0, 0)),
        stride(a.at(t0, 1) - a.at(t0, 0)),
        K(a.K) {
    for (int r = 0; r < M; ++r) sum[r] = a.sum + (t0 + r) * (a.K / 16);
  }
  void quads(int64_t b, const int32_t** xq) const {
    for (int r = 0; r < M; ++r) xq[r] = reinterpret_cast<const int32_t*>(q + (b * stride + r) * QB);
  }
};

// y[r] += s dx[r] sum + m ex[r] for a block (dx, ex: its rows' steps and step-times-sums; m: the
// mins, a vector per weight row, or none).
template <int M>
inline void scale_into(VF* __restrict y, const VI* acc, VF s, const VF* m, const float* dx, const float* ex) {
  for (int r = 0; r < M; ++r) {
    y[r] = fma(mul(s, set1(dx[r])), cvt(acc[r]), y[r]);
    if (m) y[r] = fma(*m, set1(ex[r]), y[r]);
  }
}

// One K-quant super-block (8 blocks of 32, one activation step dx a row) into y [H, M] (y[h ys +
// r]): each block's integer sum times its integer sub-scale added up in int32, scaled once: y +=
// d dx Σ sc sum; then the mins, y -= dmin dx Σ mn Σx, in a pass of their own (so that the sums'
// loop holds no more registers), by vpdpwssd on int16 pairs: a block's two sums of 16 against mn
// in both halves of a lane. Q6_K: per 16 features a signed scale, the codes' 32 taken off as 32 d
// dx Σ sc Σx (the two halves' scales a pair). |int32| <= 16 x 128 x 16 x 63 x 127 < 2^31.
// The prefetch of the super-block at pf (none if null: Fetch's) is spread over its blocks, a
// share with each: all at the super-block's start (Q6_K's 53 lines) held Q6_K / Q5_K to 0.85x.
template <int M, int H, int64_t TYPE>
inline void kquant_superblock(const uint8_t* p, const uint8_t* pf, const Rows8<M>& x, int64_t s,
                              VF* __restrict y, int ys) {
  constexpr int64_t PF = superblock_bytes(TYPE) / 8;  // a block's share of the prefetch
  VI acc[H * M], isum[H * M];
  const int32_t* xq[M];
  for (int i = 0; i < H * M; ++i) isum[i] = zero_i();
  if constexpr (TYPE == Q4_K) {  // both halves take each row's broadcasts
    for (int j = 0; j < 8; ++j) {
      if (pf) prefetch_bytes(pf + j * PF, PF);
      x.quads(s * 8 + j, xq);
      for (int i = 0; i < H * M; ++i) acc[i] = zero_i();
      dot_u4<M, H>(p + 320 + j * 256, xq, acc);
      for (int h = 0; h < H; ++h) {
        const VI sc = sub_scale(u8i(p + 64 + j * 16 + h * L));
        for (int r = 0; r < M; ++r)
          isum[h * M + r] = add(isum[h * M + r], times_sub_scale(acc[h * M + r], sc));
      }
    }
  } else {  // a half at a time: the high bits' vectors fill the registers
    for (int h = 0; h < H; ++h) {
      const int rb = h * L, cb = 4 * rb;
      for (int j = 0; j < 8; ++j) {
        if (pf) prefetch_bytes(pf + (h * 8 + j) * (PF / H), PF / H);
        x.quads(s * 8 + j, xq);
        if constexpr (TYPE == Q6_K) {
          const VI sc0 = sub_scale(s8i(p + 32 + (2 * j) * 16 + rb)),
                   sc1 = sub_scale(s8i(p + 32 + (2 * j + 1) * 16 + rb));
          dot_q6<M>(p + 288 + j * 384 + cb, xq, sc0, sc1, isum + h * M);
        } else {
          for (int r = 0; r < M; ++r) acc[r] = zero_i();
          dot_u5<M>(p + 320 + j * 256 + cb, p + 2368 + j * 64 + cb, xq, acc);
          const VI sc = u8i(p + 64 + j * 16 + rb);
          for (int r = 0; r < M; ++r) isum[h * M + r] = add(isum[h * M + r], mullo(acc[r], sc));
        }
      }
    }
  }
  const float* dx = x.d + s * 8 * x.stride;  // the super-block's step (each of its blocks')
  const int32_t* xs[M];  // the rows' pairs of sums of 16 codes (one a block) at this super-block
  for (int r = 0; r < M; ++r) xs[r] = reinterpret_cast<const int32_t*>(x.sum[r] + 16 * s);
  for (int h = 0; h < H; ++h) {
    const VF d = f16(p + 2 * h * L);
    for (int r = 0; r < M; ++r) {
      y[h * ys + r] = fma(mul(d, set1(dx[r])), cvt(isum[h * M + r]), y[h * ys + r]);
      isum[h * M + r] = zero_i();
    }
  }
  for (int j = 0; j < 8; ++j)
    for (int h = 0; h < H; ++h) {
      const int rb = h * L;
      const VI w = TYPE == Q6_K ? pair16(s8i(p + 32 + (2 * j) * 16 + rb), s8i(p + 32 + (2 * j + 1) * 16 + rb))
                                : pair16(u8i(p + 192 + j * 16 + rb), u8i(p + 192 + j * 16 + rb));
      for (int r = 0; r < M; ++r) isum[h * M + r] = dotw(isum[h * M + r], w, xs[r] + j);
    }
  for (int h = 0; h < H; ++h) {
    const VF d = f16(p + 2 * h * L), m = TYPE == Q6_K ? mul(d, set1(32.f)) : f16(p + 32 + 2 * h * L);
    for (int r = 0; r < M; ++r)
      y[h * ys + r] = fma(mul(m, set1(-dx[r])), cvt(isum[h * M + r]), y[h * ys + r]);
  }
}

// The legacy types' (32 features a super-block) loop of group_rows, one for each TYPE (its
// registers allocated for its own codes: one loop for every type kept the float sums on the
// stack). The codes' offset (Q4_0's 8, Q5_0's 16, Q8_0's 128 on AVX-512) is taken off in the
// integer sums, which start at -off Σx (AVX2's int16 sums of 4-bit codes: added when widened):
// as a float term it was one more FMA a row a block on the ports the integer products take.
template <int M, int H, int64_t TYPE>
void legacy_rows(const uint8_t* g, const Rows8<M>& x, Fetch f, VF* __restrict y, int ys) {
  const int64_t sb = superblock_bytes(TYPE), blocks = x.K / QB, gb = blocks * sb;
  constexpr bool with_m = TYPE == Q4_1 || TYPE == Q5_1, u4 = TYPE == Q4_0 || TYPE == Q4_1;
  constexpr int32_t off = TYPE == Q4_0 ? 8 : TYPE == Q5_0 ? 16 : TYPE == Q8_0 ? SIGNED_OFFSET : 0;
  constexpr bool off_at_start = off != 0 && !(u4 && INT16_U4);
  VI acc[H * M];
  const int32_t* xq[M];
  for (int h = 0; h < H; ++h)
    for (int r = 0; r < M; ++r) y[h * ys + r] = zero_f();
  const float *dx = x.d, *ex = x.e;
  const int32_t* sx = x.s;
  for (int64_t s = 0; s < blocks; ++s, dx += x.stride, ex += x.stride, sx += x.stride) {
    const uint8_t* p = g + s * sb;
    prefetch_for(p, sb, gb, f);
    x.quads(s, xq);
    for (int r = 0; r < M; ++r)
      for (int h = 0; h < H; ++h) acc[h * M + r] = off_at_start ? set1i(-off * sx[r]) : zero_i();
    if constexpr (TYPE == Q8_0) {
      for (int q = 0; q < 8; ++q) {
        VI w[H];
        for (int h = 0; h < H; ++h) w[h] = load(p + 32 + q * CHUNK + h * HALF);
        for (int r = 0; r < M; ++r)
          for (int h = 0; h < H; ++h) acc[h * M + r] = dot_signed(acc[h * M + r], w[h], xq[r][q]);
      }
    } else {
      const uint8_t* c = p + (with_m ? 64 : 32);
      if constexpr (u4) {
        dot_u4<M, H>(c, xq, acc);
        for (int r = 0; r < M; ++r)
          for (int h = 0; h < H; ++h) {
            acc[h * M + r] = widen16(acc[h * M + r]);
            if constexpr (off != 0 && !off_at_start) acc[h * M + r] = sub(acc[h * M + r], off * sx[r]);
          }
      } else
        dot_u5<M, H>(c, c + 256, xq, acc);
    }
    for (int h = 0; h < H; ++h) {  // half h's per-row fields at + h L
      const VF d = f16(p + 2 * h * L);
      if constexpr (with_m) {
        const VF m = f16(p + 32 + 2 * h * L);
        scale_into<M>(y + h * ys, acc + h * M, d, &m, dx, ex);
      } else {
        scale_into<M>(y + h * ys, acc + h * M, d, nullptr, dx, ex);
      }
    }
  }
}

// The K-quants' loop of group_rows, one for each TYPE (as legacy_rows: Q4_K's registers
// allocated for its own loop: 8-12% faster at 1-16 rows than one loop for the three).
template <int M, int H, int64_t TYPE>
void kquant_rows(const uint8_t* g, const Rows8<M>& x, Fetch f, VF* __restrict y, int ys) {
  const int64_t sb = superblock_bytes(TYPE), supers = x.K / 256, gb = supers * sb;
  for (int h = 0; h < H; ++h)
    for (int r = 0; r < M; ++r) y[h * ys + r] = zero_f();
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* p = g + s * sb;
    kquant_superblock<M, H, TYPE>(p, fetch_at(p, gb, f), x, s, y, ys);
  }
}

// M activation rows [t0, t0 + M) times H vectors of a group's weight rows (AVX2: both halves,
// or the first) -> y[h ys + r]; the weight stream prefetched as f says.
template <int M, int H>
void group_rows(const uint8_t* g, int64_t type, const Acts8& a, int64_t t0, Fetch f, VF* y, int ys) {
  const Rows8<M> x(a, t0);
  switch (type) {
    case Q4_0: return legacy_rows<M, H, Q4_0>(g, x, f, y, ys);
    case Q4_1: return legacy_rows<M, H, Q4_1>(g, x, f, y, ys);
    case Q5_0: return legacy_rows<M, H, Q5_0>(g, x, f, y, ys);
    case Q5_1: return legacy_rows<M, H, Q5_1>(g, x, f, y, ys);
    case Q8_0: return legacy_rows<M, H, Q8_0>(g, x, f, y, ys);
    case Q4_K: return kquant_rows<M, H, Q4_K>(g, x, f, y, ys);
    case Q5_K: return kquant_rows<M, H, Q5_K>(g, x, f, y, ys);
    default: return kquant_rows<M, H, Q6_K>(g, x, f, y, ys);
  }
}

// Rows a pass over a group: AVX2's 16 vector registers hold 4 rows' integer sums for both halves
// and the codes (8 rows of one half spilled the float sums every block); AVX-512's 32 a tile's.
constexpr int PASS = L == 8 ? 4 : TILE;

// The tile's rows [t0 + P, t0 + M) in passes of PASS rows -> y [H, M]. A group's passes count
// from its first row t_begin over all its tiles: the first and second prefetch as Fetch says
// (AVX-512's 16 decode rows are two tiles of one pass each: the second tile fetching nothing
// left the memory idle while it ran).
template <int M, int H, int P = 0>
inline void passes(const uint8_t* g, int64_t type, const Acts8& a, int64_t t0, int64_t t_begin, VF* y) {
  if constexpr (P < M) {
    constexpr int n = std::min(PASS, M - P);
    const int64_t at = t0 + P - t_begin;
    const Fetch f = at == 0 ? Fetch::AHEAD : at == PASS ? Fetch::NEXT : Fetch::NONE;
    group_rows<n, H>(g, type, a, t0 + P, f, y + P, M);
    passes<M, H, P + n>(g, type, a, t0, t_begin, y);
  }
}

template <int M>
struct Tile {
  static void run(int64_t t0, int64_t t_begin, const uint8_t* g, int64_t type, const Acts8& a, int64_t row0,
                  int rows, const float* bias, float* out, int64_t N) {
    constexpr int HALVES = GROUP / L;  // AVX2: 2, AVX-512: 1
    VF y[HALVES * M];                  // [halves, M]
    if (rows > L)
      passes<M, HALVES>(g, type, a, t0, t_begin, y);
    else
      passes<M, 1>(g, type, a, t0, t_begin, y);
    for (int h = 0; h * L < rows; ++h)
      write_tile<M>(y + h * M, t0, row0, h, std::min(L, rows - h * L), bias, out, N);
  }
};

void run_group8(const uint8_t* g, int64_t type, const Acts8& a, int64_t t_begin, int64_t T, int64_t row0,
                int rows, const float* bias, float* out, int64_t N) {
  TORCH_CHECK(!is_kquant(type) || a.span == 256, "K-quant groups need int8 activations of span 256");
  over_tiles<Tile>(t_begin, T, t_begin, g, type % QUADS, a, row0, rows, bias, out, N);
}
#else
void run_group8(const uint8_t* g, int64_t type, const Acts8& a, int64_t t_begin, int64_t T, int64_t row0,
                int rows, const float* bias, float* out, int64_t N) {
  run_group_scalar(g, type, a, t_begin, T, row0, rows, bias, out, N);
}
#endif

}  // namespace gguf
