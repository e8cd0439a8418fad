// GGUF linears with int8 activations (gguf_linear.cpp's header: the layouts and the dispatch):
// the weight codes as unsigned bytes against the int8 activations, 4 products a 32-bit lane.
//
// Codes in quads: for each 32-feature block a group's codes are chunks of 64 bytes, byte 4i + j
// of a chunk = row i, feature 4q + j (q the chunk's quad). One vpdpbusd (AVX-512 VNNI: u8 x s8)
// with the quad of int8 activations broadcast adds 4 products to each of 16 rows' int32 sums;
// AVX2: the chunk's half of 8 rows, maddubs (u8 x s8 -> int16 pairs) then madd by ones. Codes are
// unpacked on bytes, 64 a vector. 4-bit: chunk c (0..3) holds quad c in its low nibbles, quad c + 4
// in its high ones; 8-bit: chunk q holds quad q; 5-bit high bits: one chunk, bit q for quad q;
// Q6_K's 2-bit fields: chunk c (0..1), bits 2f..2f+1 for quad c + 2f.
//
// Exact int32 sums: |code| <= 255, |x| <= 127, 32 products. AVX2's int16 pairs: codes <= 63
// (two maddubs summed: 2 x 2 x 63 x 127 < 32768 before the madd); Q8_0's signed codes one at a
// time as |w| times x with w's sign (2 x 128 x 127 < 32768). AVX-512 takes Q8_0's codes + 128
// (a xor). The codes' offsets (Q8_0's 128 there, Q4_0's 8, Q5_0's 16) and the mins (Q4_1 /
// Q5_1's m) are taken off in float, as -off d or m times the block's dx Σx (Acts8::e; each
// sum < 2^24, so its float is exact); Q6_K's 32 and Q4_K / Q5_K's dmin mn with the integer sums.
//
// K-quants take activations with one step a super-block of 256 (Acts8::span, as llama.cpp's
// Q8_K): a block's int32 sum times the block's integer sub-scale (vpmulld) adds up over the
// super-block, and the float scaling is once a super-block instead of once a block (Q6_K: two).
//
// AVX2 at one activation row (decode) is bound by its two multiplier ports (maddubs, madd, sign,
// abs share them): a group's two halves in one pass (group_both: the group streamed once, not
// re-read from L2 while the memory idles), and 4-bit / 5-bit blocks' pairs summed in int16
// before one madd (dot_chunk).
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "gguf_blocks.h"

namespace gguf {

Acts8 acts8_at(uint8_t* buf, int64_t T, int64_t K, int64_t span) {
  TORCH_CHECK((span == QB || span == 256) && K % span == 0, "int8 activations: span ", span, " for K ", K);
  return Acts8{reinterpret_cast<int8_t*>(buf),
               reinterpret_cast<float*>(buf + T * K),
               reinterpret_cast<float*>(buf + T * K + 4 * (T * K / QB)),
               reinterpret_cast<int16_t*>(buf + T * K + 8 * (T * K / QB)),
               K,
               span};
}

Acts8 quantize_acts8(const float* x, int64_t T, int64_t K, int64_t span, uint8_t* buf) {
  const Acts8 a = acts8_at(buf, T, K, span);
  quantize_acts8_rows(x, a, 0, T);
  return a;
}

void quantize_acts8_rows(const float* x_rows, const Acts8& a, int64_t t0, int64_t t1) {
  const int64_t off = t0 * a.K, span = a.span;  // x_rows[i] is feature off + i of the whole [T, K]
  at::parallel_for(off / span, t1 * a.K / span, 32, [&](int64_t c0, int64_t c1) {
    for (int64_t s = c0; s < c1; ++s) {
      const float* xs = x_rows + (s * span - off);
      float amax = 0.f;
      for (int i = 0; i < span; ++i) amax = std::max(amax, std::fabs(xs[i]));
      const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
      for (int64_t b = s * span / QB; b < (s + 1) * span / QB; ++b) {
        const float* xb = x_rows + (b * QB - off);
        int8_t* q = a.q + b * QB;
        int32_t s0 = 0, s1 = 0;
        for (int i = 0; i < QB; ++i) q[i] = (int8_t)std::nearbyint(xb[i] * inv);
        for (int i = 0; i < 16; ++i) s0 += q[i], s1 += q[16 + i];
        a.d[b] = d, a.e[b] = d * (float)(s0 + s1);
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
inline VI zero_i() { return _mm512_setzero_si512(); }
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
// acc + the int16 pairs of a times the pair at x (2 products a lane).
inline VI dotw(VI acc, VI a, const int32_t* x) { return _mm512_dpwssd_epi32(acc, a, _mm512_set1_epi32(*x)); }
// Lanes a (< 2^15) as the low int16 of each pair, b as the high.
inline VI pair16(VI a, VI b) { return _mm512_mask_blend_epi16(0xAAAAAAAA, a, _mm512_slli_epi32(b, 16)); }
inline VI add(VI a, VI b) { return _mm512_add_epi32(a, b); }
inline VI mullo(VI a, VI b) { return _mm512_mullo_epi32(a, b); }
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
inline VI zero_i() { return _mm256_setzero_si256(); }
inline VI sub(VI a, int32_t b) { return _mm256_sub_epi32(a, _mm256_set1_epi32(b)); }
// The int16 pair sums of (codes w0, quad x0) and (w1, x1) (|each| <= 2 x 63 x 127), and their
// int32 sums a lane (the pairs widened by madd with ones).
inline VI pairs16(VI w0, int32_t x0, VI w1, int32_t x1) {
  return _mm256_add_epi16(_mm256_maddubs_epi16(w0, _mm256_set1_epi32(x0)),
                          _mm256_maddubs_epi16(w1, _mm256_set1_epi32(x1)));
}
inline VI widen16(VI p) { return _mm256_madd_epi16(p, _mm256_set1_epi16(1)); }
inline VI dot2(VI acc, VI w0, int32_t x0, VI w1, int32_t x1) {
  return _mm256_add_epi32(acc, widen16(pairs16(w0, x0, w1, x1)));
}
inline VI dot_signed(VI acc, VI w, int32_t x) {
  return _mm256_add_epi32(
      acc, widen16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(_mm256_set1_epi32(x), w))));
}
constexpr int SIGNED_OFFSET = 0;
inline VI dotw(VI acc, VI a, const int32_t* x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, _mm256_set1_epi32(*x)));
}
inline VI pair16(VI a, VI b) { return _mm256_blend_epi16(a, _mm256_slli_epi32(b, 16), 0xAA); }
inline VI add(VI a, VI b) { return _mm256_add_epi32(a, b); }
inline VI mullo(VI a, VI b) { return _mm256_mullo_epi32(a, b); }
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
// Super-block p of a group of gb bytes, pass h: the first pass streams the group, PREFETCH_AHEAD
// ahead; a second (AVX2: a group's rows 8-15) reads it from the cache, so it fetches the NEXT
// group's super-block meanwhile (the memory was idle for half the time; a prefetch past the
// weight's end does not fault).
inline void prefetch_for(const uint8_t* p, int64_t sb, int64_t gb, int h) {
  prefetch_bytes(h == 0 ? p + PREFETCH_AHEAD : p + gb, sb);
}

constexpr int CHUNK = 64;  // bytes of a chunk (16 rows x 4 features)

// The activation quads of block b of rows t0...
template <int M>
inline void quads(const Acts8& a, int64_t t0, int64_t b, const int32_t** xq) {
  for (int r = 0; r < M; ++r) xq[r] = reinterpret_cast<const int32_t*>(a.q + (t0 + r) * a.K + b * QB);
}

// acc[r] += the products of chunk k's codes lo (quad k) and hi (quad k + 4) with row r's quads,
// for the chunks k = 0..3 of a block in order. AVX2: G chunks' pairs summed in int16 (s16)
// before one madd widens them (the madds share AVX2's two multiplier ports with the maddubs):
// codes <= 15, up to G = 4 (8 maddubs pairs, |sum| <= 8 x 2 x 15 x 127 = 30480); codes <= 31,
// up to 2. Taken at one activation row (G = 1 is a madd a chunk, as before: at 2 rows the
// longer int16 sums measured slower).
template <int M, int G>
inline void dot_chunk(int k, VI lo, VI hi, const int32_t* const* xq, VI* acc, VI* s16) {
  for (int r = 0; r < M; ++r) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
    acc[r] = dot2(acc[r], lo, xq[r][k], hi, xq[r][k + 4]);
#else
    const VI p = pairs16(lo, xq[r][k], hi, xq[r][k + 4]);
    s16[r] = k % G ? _mm256_add_epi16(s16[r], p) : p;
    if (k % G == G - 1) acc[r] = add(acc[r], widen16(s16[r]));
#endif
  }
}

// One block of 4-bit codes (4 chunks at `c`) into M rows' sums.
template <int M>
inline void dot_u4(const uint8_t* c, const int32_t* const* xq, VI* acc) {
  VI s16[M];
  for (int r = 0; r < M; ++r) acc[r] = zero_i(), s16[r] = zero_i();
  for (int k = 0; k < 4; ++k) {
    const VI v = load(c + k * CHUNK), lo = and_(v, 15), hi = and_(srl(v, 4), 15);
    dot_chunk<M, M == 1 ? 4 : 1>(k, lo, hi, xq, acc, s16);
  }
}

// One block of 5-bit codes: the 4-bit chunks `c`, the chunk of high bits `h` (bit q: quad q).
template <int M>
inline void dot_u5(const uint8_t* c, const uint8_t* h, const int32_t* const* xq, VI* acc) {
  VI s16[M];
  for (int r = 0; r < M; ++r) acc[r] = zero_i(), s16[r] = zero_i();
  const VI hb = load(h);
  for (int k = 0; k < 4; ++k) {
    const VI v = load(c + k * CHUNK);
    const VI lo = low_high(v, and_(sll(hb, 4 - k), 0x10)), hi = low_high(srl(v, 4), and_(srl(hb, k), 0x10));
    dot_chunk<M, M == 1 ? 2 : 1>(k, lo, hi, xq, acc, s16);
  }
}

// One Q6_K block: quads 0-3 (features 0-15) into acc, 4-7 into acc2 (their own scales).
template <int M>
inline void dot_q6(const uint8_t* c, const uint8_t* h, const int32_t* const* xq, VI* acc, VI* acc2) {
  for (int r = 0; r < M; ++r) acc[r] = zero_i(), acc2[r] = zero_i();
  // Each high chunk's fields 0 and 2 (mask 0x33) and 1 and 3 (0xcc), then each field moved to
  // bits 4-5 with zeros above (the bits below are the low nibble's).
  const VI h0 = load(h), h1 = load(h + CHUNK);
  const VI a0 = and_(h0, 0x33), b0 = and_(h0, (int8_t)0xcc), a1 = and_(h1, 0x33), b1 = and_(h1, (int8_t)0xcc);
  const VI hq[8] = {sll(a0, 4), sll(a1, 4), sll(b0, 2), sll(b1, 2), a0, a1, srl(b0, 2), srl(b1, 2)};
  for (int k = 0; k < 4; k += 2) {
    const VI v0 = load(c + k * CHUNK), v1 = load(c + (k + 1) * CHUNK);
    const VI q0 = low_high(v0, hq[k]), q1 = low_high(v1, hq[k + 1]);
    const VI q4 = low_high(srl(v0, 4), hq[k + 4]), q5 = low_high(srl(v1, 4), hq[k + 5]);
    for (int r = 0; r < M; ++r) {
      acc[r] = dot2(acc[r], q0, xq[r][k], q1, xq[r][k + 1]);
      acc2[r] = dot2(acc2[r], q4, xq[r][k + 4], q5, xq[r][k + 5]);
    }
  }
}

// A tile's rows of activations: each row's codes, steps and step-times-sums (Acts8's e), as
// pointers held in registers (the loops' stores of float vectors may alias Acts8's fields, so
// the compiler reloaded them and redid the index arithmetic for every row of every block).
template <int M>
struct Rows8 {
  const int8_t* q[M];
  const float* d[M];
  const float* e[M];
  Rows8(const Acts8& a, int64_t t0) {
    for (int r = 0; r < M; ++r)
      q[r] = a.q + (t0 + r) * a.K, d[r] = a.d + (t0 + r) * (a.K / QB), e[r] = a.e + (t0 + r) * (a.K / QB);
  }
  void quads(int64_t b, const int32_t** xq) const {
    for (int r = 0; r < M; ++r) xq[r] = reinterpret_cast<const int32_t*>(q[r] + b * QB);
  }
};

// y[r] += s dx sum + mo dx Σx for block b (mo: a vector per row: the min m, or the codes'
// offset as -off s; none where neither). Float: the offset's product with Σx needed an
// integer multiply and a broadcast from a general register for each row.
template <int M>
inline void scale_into(VF* y, const VI* acc, VF s, const VF* mo, const Rows8<M>& x, int64_t b) {
  for (int r = 0; r < M; ++r) {
    y[r] = fma(mul(s, set1(x.d[r][b])), cvt(acc[r]), y[r]);
    if (mo) y[r] = fma(*mo, set1(x.e[r][b]), y[r]);
  }
}

// One K-quant super-block (8 blocks of 32, one activation step dx a row) into y[M]: each
// block's integer sum times its integer sub-scale added up in int32, scaled once: y += d dx Σ sc
// sum; then the mins, y -= dmin dx Σ mn Σx, in a pass of their own (so that the sums' loop holds
// no more registers), by vpdpwssd on int16 pairs: a block's two sums of 16 against mn in both
// halves of a lane. Q6_K: per 16 features a signed scale, the codes' 32 taken off as 32 d dx Σ sc
// Σx (the two halves' scales a pair). |int32| <= 16 x 128 x 16 x 63 x 127 < 2^31.
template <int M>
inline void kquant_superblock(const uint8_t* p, int64_t type, const Acts8& a, int64_t t0, int64_t s, int rb,
                              VF* y) {
  const int cb = 4 * rb;
  VI acc[M], acc2[M], isum[M];
  const int32_t* xq[M];
  for (int r = 0; r < M; ++r) isum[r] = zero_i();
  for (int j = 0; j < 8; ++j) {
    quads<M>(a, t0, s * 8 + j, xq);
    if (type == Q6_K) {
      dot_q6<M>(p + 288 + j * 256 + cb, p + 288 + 2048 + j * 128 + cb, xq, acc, acc2);
      const VI sc0 = s8i(p + 32 + (2 * j) * 16 + rb), sc1 = s8i(p + 32 + (2 * j + 1) * 16 + rb);
      for (int r = 0; r < M; ++r) isum[r] = add(isum[r], add(mullo(acc[r], sc0), mullo(acc2[r], sc1)));
    } else {
      if (type == Q4_K)
        dot_u4<M>(p + 320 + j * 256 + cb, xq, acc);
      else
        dot_u5<M>(p + 320 + j * 256 + cb, p + 2368 + j * 64 + cb, xq, acc);
      const VI sc = u8i(p + 64 + j * 16 + rb);
      for (int r = 0; r < M; ++r) isum[r] = add(isum[r], mullo(acc[r], sc));
    }
  }
  const VF d = f16(p + 2 * rb), m = type == Q6_K ? mul(d, set1(32.f)) : f16(p + 32 + 2 * rb);
  float dx[M];
  const int32_t* xs[M];  // the rows' pairs of sums of 16 codes (one a block) at this super-block
  for (int r = 0; r < M; ++r) {
    dx[r] = a.d[(t0 + r) * (a.K / QB) + s * 8];
    xs[r] = reinterpret_cast<const int32_t*>(a.sum + (t0 + r) * (a.K / 16) + 16 * s);
    y[r] = fma(mul(d, set1(dx[r])), cvt(isum[r]), y[r]);
    isum[r] = zero_i();
  }
  for (int j = 0; j < 8; ++j) {
    const VI w = type == Q6_K ? pair16(s8i(p + 32 + (2 * j) * 16 + rb), s8i(p + 32 + (2 * j + 1) * 16 + rb))
                              : pair16(u8i(p + 192 + j * 16 + rb), u8i(p + 192 + j * 16 + rb));
    for (int r = 0; r < M; ++r) isum[r] = dotw(isum[r], w, xs[r] + j);
  }
  for (int r = 0; r < M; ++r) y[r] = fma(mul(m, set1(-dx[r])), cvt(isum[r]), y[r]);
}

// One block of a legacy type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) at p, the L rows from row rb (codes
// at + 4 rb a chunk), into M rows' sums yr: the block's integer sums, scaled (scale_into).
template <int M>
inline void legacy_block(const uint8_t* p, int64_t type, const Rows8<M>& x, const int32_t* const* xq,
                         int64_t s, int rb, VF* yr) {
  const int cb = 4 * rb;
  const bool with_m = type == Q4_1 || type == Q5_1;
  const float off = type == Q4_0 ? 8.f : type == Q5_0 ? 16.f : type == Q8_0 ? (float)SIGNED_OFFSET : 0.f;
  VI acc[M];
  if (type == Q8_0) {
    const uint8_t* c = p + 32 + cb;
    for (int r = 0; r < M; ++r) acc[r] = zero_i();
    for (int q = 0; q < 8; ++q) {
      const VI w = load(c + q * CHUNK);
      for (int r = 0; r < M; ++r) acc[r] = dot_signed(acc[r], w, xq[r][q]);
    }
  } else {
    const uint8_t* c = p + (with_m ? 64 : 32);
    if (type == Q4_0 || type == Q4_1)
      dot_u4<M>(c + cb, xq, acc);
    else
      dot_u5<M>(c + cb, c + 256 + cb, xq, acc);
  }
  const VF d = f16(p + 2 * rb);
  const VF mo = with_m ? f16(p + 32 + 2 * rb) : mul(d, set1(-off));
  scale_into<M>(yr, acc, d, with_m || off != 0.f ? &mo : nullptr, x, s);
}

// M activation rows [t0, t0 + M) times the L rows of one half (`h`) of a group -> y[M].
template <int M>
void group_rows(const uint8_t* g, int64_t type, const Acts8& a, int64_t t0, int h, VF* y) {
  const int64_t K = a.K, sb = superblock_bytes(type), sf = superblock_features(type), gb = K / sf * sb;
  const int rb = h * L;  // this half's first row
  for (int r = 0; r < M; ++r) y[r] = zero_f();
  if (is_kquant(type)) {
    for (int64_t s = 0; s < K / sf; ++s) {
      const uint8_t* p = g + s * sb;
      prefetch_for(p, sb, gb, h);
      kquant_superblock<M>(p, type, a, t0, s, rb, y);
    }
    return;
  }
  const Rows8<M> x(a, t0);
  VF yr[M];  // the sums in registers, stored once
  const int32_t* xq[M];
  for (int r = 0; r < M; ++r) yr[r] = zero_f();
  for (int64_t s = 0; s < K / QB; ++s) {
    const uint8_t* p = g + s * sb;
    prefetch_for(p, sb, gb, h);
    x.quads(s, xq);
    legacy_block<M>(p, type, x, xq, s, rb, yr);
  }
  for (int r = 0; r < M; ++r) y[r] = yr[r];
}

// AVX2 (a group is two halves of L = 8 rows) at one activation row (decode): both halves of each
// super-block in turn, so the group is streamed from memory once, instead of once for the first
// half and again from L2 for the second (a pass during which the memory was idle). The same
// integer sums and float steps per half as group_rows (outputs bit for bit): y[M] for rows 0-7,
// then y[M] for rows 8-15. At 2 rows GCC kept the sums and quads of both halves on the stack
// (Q4_0 slower than two passes, Q8_0 faster): one row only, until a kernel broadcasts each quad
// once for the 16 rows.
constexpr int64_t ONE_PASS_AHEAD = 1024;  // bytes: the stream's prefetch distance (T1)
// A legacy TYPE known at compile time: a straight loop (with the type's branches in it GCC kept
// the sums on the stack).
template <int M, int64_t TYPE>
void legacy_both(const uint8_t* g, const Acts8& a, int64_t t0, VF* y) {
  const int64_t sb = superblock_bytes(TYPE);
  const Rows8<M> x(a, t0);
  VF yr[2 * M];
  const int32_t* xq[M];
  for (int r = 0; r < 2 * M; ++r) yr[r] = zero_f();
  for (int64_t s = 0; s < a.K / QB; ++s) {
    const uint8_t* p = g + s * sb;
    prefetch_bytes(p + ONE_PASS_AHEAD, sb);
    x.quads(s, xq);
    legacy_block<M>(p, TYPE, x, xq, s, 0, yr);
    legacy_block<M>(p, TYPE, x, xq, s, L, yr + M);
  }
  for (int r = 0; r < 2 * M; ++r) y[r] = yr[r];
}

template <int M>
void group_both(const uint8_t* g, int64_t type, const Acts8& a, int64_t t0, VF* y) {
  switch (type) {
    case Q4_0: return legacy_both<M, Q4_0>(g, a, t0, y);
    case Q4_1: return legacy_both<M, Q4_1>(g, a, t0, y);
    case Q5_0: return legacy_both<M, Q5_0>(g, a, t0, y);
    case Q5_1: return legacy_both<M, Q5_1>(g, a, t0, y);
    case Q8_0: return legacy_both<M, Q8_0>(g, a, t0, y);
  }
  const int64_t sb = superblock_bytes(type);
  for (int r = 0; r < 2 * M; ++r) y[r] = zero_f();
  for (int64_t s = 0; s < a.K / 256; ++s) {
    const uint8_t* p = g + s * sb;
    prefetch_bytes(p + ONE_PASS_AHEAD, sb);
    kquant_superblock<M>(p, type, a, t0, s, 0, y);
    kquant_superblock<M>(p, type, a, t0, s, L, y + M);
  }
}

template <int M>
struct Tile {
  static void run(int64_t t0, const uint8_t* g, int64_t type, const Acts8& a, int64_t row0, int rows,
                  const float* bias, float* out, int64_t N) {
    if constexpr (L == 8 && M == 1) {
      if (rows > L) {  // both halves, one pass
        VF y[2 * M];
        group_both<M>(g, type, a, t0, y);
        write_tile<M>(y, t0, row0, 0, L, bias, out, N);
        write_tile<M>(y + M, t0, row0, 1, rows - L, bias, out, N);
        return;
      }
    }
    for (int h = 0; h * L < rows; ++h) {
      VF y[M];
      group_rows<M>(g, type, a, t0, h, y);
      write_tile<M>(y, t0, row0, h, std::min(L, rows - h * L), bias, out, N);
    }
  }
};

void run_group8(const uint8_t* g, int64_t type, const Acts8& a, int64_t t_begin, int64_t T, int64_t row0,
                int rows, const float* bias, float* out, int64_t N) {
  TORCH_CHECK(!is_kquant(type) || a.span == 256, "K-quant groups need int8 activations of span 256");
  over_tiles<Tile>(t_begin, T, g, type % QUADS, a, row0, rows, bias, out, N);
}
#else
void run_group8(const uint8_t* g, int64_t type, const Acts8& a, int64_t t_begin, int64_t T, int64_t row0,
                int rows, const float* bias, float* out, int64_t N) {
  run_group_scalar(g, type, a, t_begin, T, row0, rows, bias, out, N);
}
#endif

}  // namespace gguf
