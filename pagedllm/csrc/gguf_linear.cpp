// Linears on GGUF's block-quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) held in the
// file's bytes, repacked at load (models/layers/quantization/gguf_repack.py) so that one SIMD lane is one
// weight row: y = x W^T + b, float32 activations, any number of rows. The activations are
// quantized per block of 32 to int8 (the default: gguf_int8.cpp, 4 products a lane) or int16
// (this file, 2 a lane; PAGEDLLM_GGUF_ACTIVATIONS), each with its own order of the codes.
//
// Layout. Output rows in groups of 16; a group's bytes, for each super-block of its type (32
// features: Q4_0 / Q4_1 / Q8_0; 256: Q4_K / Q6_K), are the 16 rows' per-row fields (float16 d,
// m, dmin; 8-bit sub-block scales) as arrays of 16, then the integer codes in chunks of 16 W
// bytes: byte W i + j of a chunk belongs to row i, feature W u + j of a 32-feature block (u the
// chunk's unit of W features: pairs, W = 2, for int16 activations; quads, W = 4, for int8). Of
// a block's U = 32 / W units: 4-bit codes, chunk c holds unit c in its low nibbles and unit
// c + U/2 in its high ones; 8-bit: chunk u holds unit u; 5-bit: the 4-bit chunks, then chunks of
// 1-bit fields (chunk c, bit f: unit c + (U/8) f); Q6_K: the 4-bit chunks, then chunks of 2-bit
// fields (chunk c, field f: unit c + (U/4) f). Pairs: a chunk widened to int16 (vpmovzxbw) is 16
// rows x 2 features, one vpdpwssd with the pair of int16 activations broadcast adds 2 products to
// each row's sum. Quads: gguf_int8.cpp. Bytes a row: the file's (Q4_K: 148 for 144, Q5_K 180 for 176).
//
// A weight tensor is a run of groups, each with its own type (a fused QKV may mix Q4_K and
// Q6_K), described by `meta` [G, 4] int64: byte offset, GGML type (+ QUADS when the codes are
// in quads), first output row, rows (<= 16; the last group of a segment is padded with zero rows).
//
// int16 activations: each input row quantized in blocks of 32 (d = amax / 32767) with the float
// sums of each 16 features for the mins and offsets (Q4_0's -8 d, Q5_0's -16 d, Q6_K's -32 d sc,
// Q4_1 / Q5_1's m, Q4_K / Q5_K's -dmin mn). Each block's 16 row sums are exact int32 (|code| <=
// 128, |x| <= 32767, 32 products), scaled in float32: y += (s dx) sum + m xsum.
//
// Threads over row groups (decode rows: runs of groups claimed in turn); within a group the
// activation rows in tiles of 8 (each tile reuses the group's codes from L1), so 1-8 rows
// (decode) and prefill share one kernel; many rows in chunks that stay in L2 while every group
// passes. AVX-512 (VNNI): 16 rows a vector; AVX2: 8, each group in two halves (madd + add for
// vpdpwssd). Others: scalar.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_types.h"
#include "gguf_blocks.h"
#include "gguf_groups.h"
#include "ops.h"

namespace gguf {

// One row's code of feature k (0..31) of a block, codes in units of W features (2: pairs, 4:
// quads; 32 / W units, chunks of 16 W bytes). 4-bit: chunk u % (U / 2) holds unit u in its low
// nibbles (u < U / 2) or high ones; 1-bit fields: chunk u % (U / 8), bit u / (U / 8); 2-bit:
// chunk u % (U / 4), field u / (U / 4); 8-bit: chunk u.
inline int u4_code(const uint8_t* chunks, int W, int row, int k) {
  const int u = k / W, j = k % W, U = QB / W;
  const uint8_t b = chunks[(u % (U / 2)) * 16 * W + W * row + j];
  return u < U / 2 ? (b & 15) : (b >> 4);
}
inline int u5_code(const uint8_t* lo, const uint8_t* hi, int W, int row, int k) {
  const int u = k / W, j = k % W, n = QB / W / 8;
  return u4_code(lo, W, row, k) | (((hi[(u % n) * 16 * W + W * row + j] >> (u / n)) & 1) << 4);
}
inline int q6_code(const uint8_t* lo, const uint8_t* hi, int W, int row, int k) {
  const int u = k / W, j = k % W, n = QB / W / 4;
  return u4_code(lo, W, row, k) | (((hi[(u % n) * 16 * W + W * row + j] >> (2 * (u / n))) & 3) << 4);
}
// Q6_K's codes in quads (gguf_int8.cpp): quad u = 4h + i of a block, i < 3 in bits 0-5 of chunk
// 3h + i; quad 4h + 3's bits 2i..2i+1 in bits 6-7 of chunk 3h + i.
inline int q6_quad_code(const uint8_t* c, int row, int k) {
  const int h = k / 16, i = k / 4 % 4, at = 4 * row + k % 4;
  if (i < 3) return c[(3 * h + i) * 64 + at] & 63;
  int q = 0;
  for (int f = 0; f < 3; ++f) q |= (c[(3 * h + f) * 64 + at] >> 6) << (2 * f);
  return q;
}

// The reference the scalar kernels and the embedding lookup use.
void dequantize_group_row(const uint8_t* g, int64_t layout_type, int64_t K, int row, float* out) {
  const int64_t type = layout_type % QUADS, sb = superblock_bytes(type), sf = superblock_features(type);
  const int W = layout_type >= QUADS ? 4 : 2;
  for (int64_t s = 0; s < K / sf; ++s) {
    const uint8_t* p = g + s * sb;
    const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
    float* o = out + s * sf;
    if (type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 || type == Q8_0) {
      const bool with_m = type == Q4_1 || type == Q5_1;
      const float d = h2f(h[row]);
      const float m = with_m ? h2f(h[16 + row]) : (type == Q4_0 ? -8.f * d : type == Q5_0 ? -16.f * d : 0.f);
      const uint8_t* c = p + (with_m ? 64 : 32);
      for (int k = 0; k < QB; ++k) {
        const int q = type == Q8_0                     ? (int8_t)c[(k / W) * 16 * W + W * row + k % W]
                      : (type == Q5_0 || type == Q5_1) ? u5_code(c, c + 256, W, row, k)
                                                       : u4_code(c, W, row, k);
        o[k] = q * d + m;
      }
    } else if (type == Q4_K || type == Q5_K) {
      const float d = h2f(h[row]), dmin = h2f(h[16 + row]);
      for (int j = 0; j < 8; ++j) {
        const float sc = d * p[64 + j * 16 + row], mn = dmin * p[192 + j * 16 + row];
        const uint8_t* lo = p + 320 + j * 256;
        for (int k = 0; k < QB; ++k)
          o[j * QB + k] =
              (type == Q4_K ? u4_code(lo, W, row, k) : u5_code(lo, p + 2368 + j * 64, W, row, k)) * sc - mn;
      }
    } else {  // Q6_K
      const float d = h2f(h[row]);
      for (int j = 0; j < 8; ++j) {
        const uint8_t *lo = p + 288 + j * 256, *hi = p + 288 + 2048 + j * 128, *c = p + 288 + j * 384;
        for (int k = 0; k < QB; ++k) {
          const float sc = d * (int8_t)p[32 + (2 * j + k / 16) * 16 + row];
          o[j * QB + k] = ((W == 4 ? q6_quad_code(c, row, k) : q6_code(lo, hi, W, row, k)) - 32) * sc;
        }
      }
    }
  }
}

}  // namespace gguf

namespace {

using namespace gguf;
constexpr float QMAX = 32767.f;

// The activations of T rows: int16 codes in blocks of 32 (as int32 pairs), each block's step,
// the float sums of each 16 features.
struct Acts {
  std::vector<int16_t> q;  // [T, K]
  std::vector<float> d;    // [T, K/32]
  std::vector<float> sum;  // [T, K/16]
  int64_t K;
  float step(int64_t t, int64_t block) const { return d[t * (K / QB) + block]; }
  int code(int64_t t, int64_t k) const { return q[t * K + k]; }
  const int32_t* pairs(int64_t t, int64_t block) const {
    return reinterpret_cast<const int32_t*>(q.data() + t * K + block * QB);
  }
};

Acts quantize_acts(const float* x, int64_t T, int64_t K) {
  Acts a{std::vector<int16_t>(T * K), std::vector<float>(T * K / QB), std::vector<float>(T * K / 16), K};
  at::parallel_for(0, T * K / QB, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* xb = x + b * QB;
      float amax = 0.f, s0 = 0.f, s1 = 0.f;
      for (int i = 0; i < QB; ++i) amax = std::max(amax, std::fabs(xb[i]));
      for (int i = 0; i < 16; ++i) s0 += xb[i], s1 += xb[16 + i];
      const float d = amax / QMAX, inv = d > 0.f ? 1.f / d : 0.f;
      a.d[b] = d;
      a.sum[2 * b] = s0, a.sum[2 * b + 1] = s1;
      for (int i = 0; i < QB; ++i) a.q[b * QB + i] = (int16_t)std::nearbyint(xb[i] * inv);
    }
  });
  return a;
}

#ifdef GGUF_SIMD
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
using VI = __m512i;
inline VI widen_u8(const uint8_t* p) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p)); }
inline VI widen_s8(const uint8_t* p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p)); }
inline VI and_(VI v, int16_t m) { return _mm512_and_si512(v, _mm512_set1_epi16(m)); }
inline VI or_(VI a, VI b) { return _mm512_or_si512(a, b); }
inline VI srl(VI v, int n) { return _mm512_srli_epi16(v, n); }
inline VI sll(VI v, int n) { return _mm512_slli_epi16(v, n); }
inline VI zero_i() { return _mm512_setzero_si512(); }
inline VI dot(VI acc, VI w, int32_t x) { return _mm512_dpwssd_epi32(acc, w, _mm512_set1_epi32(x)); }
#else
using VI = __m256i;
inline VI widen_u8(const uint8_t* p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p)); }
inline VI widen_s8(const uint8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p)); }
inline VI and_(VI v, int16_t m) { return _mm256_and_si256(v, _mm256_set1_epi16(m)); }
inline VI or_(VI a, VI b) { return _mm256_or_si256(a, b); }
inline VI srl(VI v, int n) { return _mm256_srli_epi16(v, n); }
inline VI sll(VI v, int n) { return _mm256_slli_epi16(v, n); }
inline VI zero_i() { return _mm256_setzero_si256(); }
inline VI dot(VI acc, VI w, int32_t x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(w, _mm256_set1_epi32(x)));
}
#endif

// One 32-feature block of 4-bit codes (chunks c: pairs c, c + 8) into M rows' sums.
template <int M>
inline void dot_u4(const uint8_t* chunks, const Acts& a, int64_t t0, int64_t b, VI* acc) {
  const int32_t* xp[M];
  for (int r = 0; r < M; ++r) xp[r] = a.pairs(t0 + r, b), acc[r] = zero_i();
  for (int c = 0; c < 8; ++c) {
    const VI v = widen_u8(chunks + c * 32), lo = and_(v, 15), hi = srl(v, 4);
    for (int r = 0; r < M; ++r) acc[r] = dot(dot(acc[r], lo, xp[r][c]), hi, xp[r][c + 8]);
  }
}

// Bit f of each byte of v moved to bit 4 (the 5-bit codes' high bit).
inline VI bit_to_4(VI v, int f) { return and_(f <= 4 ? sll(v, 4 - f) : srl(v, f - 4), 0x10); }

// One 32-feature block of 5-bit codes: the 4-bit chunks `lo`, the 1-bit chunks `hi` (pair p:
// chunk p % 2, bit p / 2).
template <int M>
inline void dot_u5(const uint8_t* lo, const uint8_t* hi, const Acts& a, int64_t t0, int64_t b, VI* acc) {
  const int32_t* xp[M];
  for (int r = 0; r < M; ++r) xp[r] = a.pairs(t0 + r, b), acc[r] = zero_i();
  const VI h[2] = {widen_u8(hi), widen_u8(hi + 32)};
  for (int c = 0; c < 8; ++c) {
    const VI v = widen_u8(lo + c * 32);
    const VI c0 = or_(and_(v, 15), bit_to_4(h[c % 2], c / 2)),
             c8 = or_(srl(v, 4), bit_to_4(h[c % 2], c / 2 + 4));
    for (int r = 0; r < M; ++r) acc[r] = dot(dot(acc[r], c0, xp[r][c]), c8, xp[r][c + 8]);
  }
}

// y[r] += (s dx) sum + m xsum for one block (m: a vector per row, or none).
template <int M>
inline void scale_into(VF* y, const VI* acc, VF s, const VF* m, const Acts& a, int64_t t0, int64_t b,
                       int64_t half) {
  for (int r = 0; r < M; ++r) {
    y[r] = fma(mul(s, set1(a.d[(t0 + r) * (a.K / QB) + b])), cvt(acc[r]), y[r]);
    if (m) {
      const float* xs = a.sum.data() + (t0 + r) * (a.K / 16) + 2 * b;
      y[r] = fma(*m, set1(half < 0 ? xs[0] + xs[1] : xs[half]), y[r]);
    }
  }
}

// M activation rows [t0, t0 + M) times the L rows of one half (`h`) of a group -> y[M].
template <int M>
void group_rows(const uint8_t* g, int64_t type, const Acts& a, int64_t t0, int h, VF* y) {
  const int64_t K = a.K, sb = superblock_bytes(type), sf = superblock_features(type);
  const int rb = h * L;  // this half's first row: per-row arrays at +rb, chunks at +2 rb bytes
  for (int r = 0; r < M; ++r) y[r] = zero_f();
  VI acc[M], acc2[M];
  for (int64_t s = 0; s < K / sf; ++s) {
    const uint8_t* p = g + s * sb;
    if (type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1) {
      const bool with_m = type == Q4_1 || type == Q5_1;
      const VF d = f16(p + 2 * rb);
      const VF m = with_m ? f16(p + 32 + 2 * rb) : mul(d, set1(type == Q4_0 ? -8.f : -16.f));
      const uint8_t* c = p + (with_m ? 64 : 32);
      if (type == Q4_0 || type == Q4_1)
        dot_u4<M>(c + 2 * rb, a, t0, s, acc);
      else
        dot_u5<M>(c + 2 * rb, c + 256 + 2 * rb, a, t0, s, acc);
      scale_into<M>(y, acc, d, &m, a, t0, s, -1);
    } else if (type == Q8_0) {
      const uint8_t* c = p + 32 + 2 * rb;
      const int32_t* xp[M];
      for (int r = 0; r < M; ++r) xp[r] = a.pairs(t0 + r, s), acc[r] = zero_i();
      for (int q = 0; q < 16; ++q) {
        const VI w = widen_s8(c + q * 32);
        for (int r = 0; r < M; ++r) acc[r] = dot(acc[r], w, xp[r][q]);
      }
      scale_into<M>(y, acc, f16(p + 2 * rb), nullptr, a, t0, s, -1);
    } else if (type == Q4_K || type == Q5_K) {
      const VF d = f16(p + 2 * rb), dmin = mul(f16(p + 32 + 2 * rb), set1(-1.f));
      for (int j = 0; j < 8; ++j) {
        const int64_t b = s * 8 + j;
        if (type == Q4_K)
          dot_u4<M>(p + 320 + j * 256 + 2 * rb, a, t0, b, acc);
        else
          dot_u5<M>(p + 320 + j * 256 + 2 * rb, p + 2368 + j * 64 + 2 * rb, a, t0, b, acc);
        const VF m = mul(dmin, u8f(p + 192 + j * 16 + rb));
        scale_into<M>(y, acc, mul(d, u8f(p + 64 + j * 16 + rb)), &m, a, t0, b, -1);
      }
    } else {  // Q6_K: per 32 features, pairs 0-7 (acc) and 8-15 (acc2) have their own scales
      const VF d = f16(p + 2 * rb);
      for (int j = 0; j < 8; ++j) {
        const int64_t b = s * 8 + j;
        const uint8_t *lo = p + 288 + j * 256 + 2 * rb, *hi = p + 288 + 2048 + j * 128 + 2 * rb;
        const int32_t* xp[M];
        for (int r = 0; r < M; ++r) xp[r] = a.pairs(t0 + r, b), acc[r] = zero_i(), acc2[r] = zero_i();
        for (int cc = 0; cc < 4; ++cc) {
          const VI hb = widen_u8(hi + cc * 32);
          // field f of hb (pair cc + 4 f) moved to bits 4-5
          const VI f0 = and_(sll(hb, 4), 0x30), f1 = and_(sll(hb, 2), 0x30), f2 = and_(hb, 0x30),
                   f3 = and_(srl(hb, 2), 0x30);
          const VI v0 = widen_u8(lo + cc * 32), v1 = widen_u8(lo + (cc + 4) * 32);
          const VI c0 = or_(and_(v0, 15), f0), c8 = or_(srl(v0, 4), f2);   // pairs cc, cc + 8
          const VI c4 = or_(and_(v1, 15), f1), c12 = or_(srl(v1, 4), f3);  // pairs cc + 4, cc + 12
          for (int r = 0; r < M; ++r) {
            acc[r] = dot(dot(acc[r], c0, xp[r][cc]), c4, xp[r][cc + 4]);
            acc2[r] = dot(dot(acc2[r], c8, xp[r][cc + 8]), c12, xp[r][cc + 12]);
          }
        }
        const VF s0 = mul(d, s8f(p + 32 + (2 * j) * 16 + rb)),
                 s1 = mul(d, s8f(p + 32 + (2 * j + 1) * 16 + rb));
        const VF m0 = mul(s0, set1(-32.f)), m1 = mul(s1, set1(-32.f));
        scale_into<M>(y, acc, s0, &m0, a, t0, b, 0);
        scale_into<M>(y, acc2, s1, &m1, a, t0, b, 1);
      }
    }
  }
}

template <int M>
struct Tile {
  static void run(int64_t t0, const uint8_t* g, int64_t type, const Acts& a, int64_t row0, int rows,
                  const float* bias, float* out, int64_t N) {
    for (int h = 0; h * L < rows; ++h) {
      VF y[M];
      group_rows<M>(g, type, a, t0, h, y);
      write_tile<M>(y, t0, row0, h, std::min(L, rows - h * L), bias, out, N);
    }
  }
};

void run_group(const uint8_t* g, int64_t type, const Acts& a, int64_t t_begin, int64_t T, int64_t row0,
               int rows, const float* bias, float* out, int64_t N) {
  over_tiles<Tile>(t_begin, T, g, type, a, row0, rows, bias, out, N);
}
#else
void run_group(const uint8_t* g, int64_t type, const Acts& a, int64_t t_begin, int64_t T, int64_t row0,
               int rows, const float* bias, float* out, int64_t N) {
  run_group_scalar(g, type, a, t_begin, T, row0, rows, bias, out, N);
}
#endif

// One tile of activation rows (decode): the groups in runs of ~CLAIM_BYTES, each run claimed by
// the next thread to ask, in order. A static half each leaves one thread waiting at the join
// (spinning in libgomp) whenever the halves take different times: mixed types in a fused weight
// (Q4_K_M's qkv where v is Q6_K), a thread that starts late (the fork's wake-up) or streams
// slower. Runs of ~256 KiB: a few hundred atomic claims for the largest weight (the LM head),
// each run long enough for the hardware prefetchers.
constexpr int64_t CLAIM_BYTES = int64_t{1} << 18;

}  // namespace

namespace gguf {

Groups check_groups(const torch::Tensor& packed, const torch::Tensor& meta, int64_t K) {
  TORCH_CHECK(packed.scalar_type() == torch::kByte && packed.is_contiguous(), "packed: contiguous uint8");
  TORCH_CHECK(
      meta.scalar_type() == torch::kLong && meta.dim() == 2 && meta.size(1) == 4 && meta.is_contiguous(),
      "meta: int64 [groups, 4]");
  const int64_t G = meta.size(0), bytes = packed.numel();
  const int64_t* m = meta.data_ptr<int64_t>();
  int64_t N = 0, type = -1, span = 0;  // span: a group's bytes at K features, for the run's type
  Layouts l{false, false, false};
  for (int64_t g = 0; g < G; ++g) {
    const int64_t* e = m + 4 * g;
    if (e[1] != type) {  // the groups come in runs of one type
      type = e[1];
      TORCH_CHECK(type >= 0 && type < 2 * QUADS, "meta row ", g, ": no GGML type ", type);
      TORCH_CHECK(K % superblock_features(type) == 0, "K ", K, " is not whole super-blocks of type ", type);
      span = K / superblock_features(type) * superblock_bytes(type);
      (type >= QUADS ? l.quads : l.pairs) = true;
      l.kquads |= type >= QUADS && is_kquant(type);
    }
    TORCH_CHECK(e[0] >= 0 && e[0] + span <= bytes && e[3] >= 1 && e[3] <= GROUP, "meta row ", g,
                " is outside the packed bytes");
    N = std::max(N, e[2] + e[3]);
  }
  return Groups{packed.data_ptr<uint8_t>(), m, G, N, l};
}

int64_t groups_per_claim(const Groups& gs, int64_t K) {
  const int64_t type = gs.meta[1];
  return std::max<int64_t>(1, CLAIM_BYTES / (K / superblock_features(type) * superblock_bytes(type)));
}

}  // namespace gguf

namespace {

template <class Run>
void run_decode_rows(const Groups& gs, int64_t K, int64_t T, const Run& run) {
  const int64_t per_claim = groups_per_claim(gs, K);
  const int64_t claims = (gs.G + per_claim - 1) / per_claim;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), claims), 1, [&](int64_t, int64_t) {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < claims;)
      for (int64_t g = c * per_claim; g < std::min(gs.G, (c + 1) * per_claim); ++g) run(g, 0, T);
  });
}

}  // namespace

// x [T, K] float32; packed uint8 and meta [G, 4] int64 (the layout above) -> [T, N] float32.
torch::Tensor gguf_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor meta,
                          c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.size(1) % QB == 0, "x: float32 [T, K]");
  x = x.contiguous();
  const int64_t T = x.size(0), K = x.size(1);
  const Groups gs = check_groups(packed, meta, K);
  TORCH_CHECK(!bias.has_value() ||
              (bias->is_contiguous() && bias->scalar_type() == torch::kFloat && bias->numel() == gs.N));
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  auto out = torch::empty({T, gs.N}, x.options());
  if (T == 0) return out;
  const auto [pairs, quads, kquads] = gs.layouts;  // the activations as each group takes them
  const Acts a = pairs ? quantize_acts(x.data_ptr<float>(), T, K) : Acts{{}, {}, {}, K};
  // From torch's allocator: 64-byte aligned and not zero-filled (a std::vector's bytes were
  // malloc's 16-byte alignment, cleared on every call).
  const auto buf8 = torch::empty({quads ? acts8_bytes(T, K) : 0}, x.options().dtype(torch::kByte));
  const Acts8 a8 =
      quads ? quantize_acts8(x.data_ptr<float>(), T, K, kquads ? 256 : QB, buf8.data_ptr<uint8_t>())
            : Acts8{};
  float* op = out.data_ptr<float>();
  auto run = [&](int64_t g, int64_t t0, int64_t t1) {
    const int64_t* e = gs.meta + 4 * g;
    if (e[1] >= QUADS)
      run_group8(gs.base + e[0], e[1], a8, t0, t1, e[2], (int)e[3], b, op, gs.N);
    else
      run_group(gs.base + e[0], e[1], a, t0, t1, e[2], (int)e[3], b, op, gs.N);
  };
  if (T <= TILE) {  // decode rows: the weight streamed once, by whichever thread is free
    run_decode_rows(gs, K, T, run);
    return out;
  }
  // Each thread passes its groups over the activation rows a chunk at a time: a chunk's codes
  // (~256 KiB of int16) stay in the core's L2 instead of every group streaming all T rows again.
  // One parallel region (no barrier per chunk: on a busy machine each costs a time slice).
  const int64_t chunk = std::max<int64_t>(TILE, (int64_t{1} << 17) / K / TILE * TILE);
  at::parallel_for(0, gs.G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t t0 = 0; t0 < T; t0 += chunk)
      for (int64_t g = g0; g < g1; ++g) run(g, t0, std::min(T, t0 + chunk));
  });
  return out;
}

// Rows `rows` [R] int64 of the packed weight as float32 [R, K] (the token embedding's lookup;
// tests: the whole weight).
torch::Tensor gguf_dequantize_rows(torch::Tensor packed, torch::Tensor meta, int64_t K, torch::Tensor rows) {
  const Groups gs = check_groups(packed, meta, K);
  TORCH_CHECK(rows.scalar_type() == torch::kLong && rows.dim() == 1, "rows: int64 [R]");
  rows = rows.contiguous();
  // Output row -> group: groups are in row order (first rows ascending).
  std::vector<int64_t> first(gs.G);
  for (int64_t g = 0; g < gs.G; ++g) first[g] = gs.meta[4 * g + 2];
  auto out = torch::empty({rows.size(0), K}, torch::TensorOptions().dtype(torch::kFloat));
  const int64_t* rp = rows.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < rows.size(0); ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < gs.N, "row ", rp[i], " is outside the weight's ", gs.N, " rows");
  at::parallel_for(0, rows.size(0), 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = std::upper_bound(first.begin(), first.end(), rp[i]) - first.begin() - 1;
      const int64_t* e = gs.meta + 4 * g;
      dequantize_group_row(gs.base + e[0], e[1], K, (int)(rp[i] - e[2]), op + i * K);
    }
  });
  return out;
}
