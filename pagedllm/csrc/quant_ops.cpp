// Weight-only int8 / int4 linears (models/layers/quantization/): y = x W^T + b with W held as
// integers q, per-group float scales s and (optionally) mins m, w = q * s + m, in groups of G
// consecutive input features of one output row. float32 activations.
//
// int8: q [N, K] int8.  int4: q [N, K/2] uint8, each run of 32 features in 16 bytes, byte i
// holding feature i (low nibble) and feature i + 16 (high nibble), values 0..15: GGUF's Q4_0 /
// Q4_1 block layout, so those files are copied, not converted. s, m [N, K/G] float32.
//
// 1-8 rows (decode, verification), groups of a multiple of 32 (AVX2): each input row is
// quantized to int16 in blocks of 32 features (quant_activations: one scale d = amax / 32767 a
// block), and each block's dot product is an exact integer sum (the weights widened to int16,
// madd; vpdpwssd where AVX-VNNI / AVX512-VNNI exist: the same sums), scaled by s d in float.
// Not int8 activations (llama.cpp's Q8 scheme): their rounding alone, on float32 weights, kept
// 63 % of float32's greedy tokens on the agreement prompts; int16 kept 100 % (docs/design.md).
// sum_k x_k (q_k s + m) = s sum_k x_k q_k + m sum_k x_k: the mins term takes the float inputs'
// group sums. Other group sizes, or no AVX2: the float kernel (8 integers widened to float32 in
// registers). 9 rows up to GEMM_ROWS: cache-sized dequantised tiles, each times the inputs by
// torch's GEMM. More (prefill): a chunk of output rows dequantised into a float32 scratch, then
// one torch GEMM over it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_types.h"
#include "ops.h"

#ifdef __AVX2__
#include <immintrin.h>
static inline __m256 widen_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
static inline __m256 widen_u8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
// Eight int32 sums of 4 products each of int16 w0 x0 and w1 x1 (exact: |w| <= 128 and
// |x| <= 32767, so no pair sum nears 2^31).
static inline __m256i dot_s16(__m256i w0, __m256i x0, __m256i w1, __m256i x1) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(_mm256_madd_epi16(w0, x0), w1, x1);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(_mm256_madd_epi16(w0, x0), w1, x1);
#else
  return _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
#endif
}
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// Integer of feature k of an int4 row (the layout above).
static inline int q4_at(const uint8_t* row, int64_t k) {
  const uint8_t b = row[(k / 32) * 16 + (k % 32) % 16];
  return (k % 32) < 16 ? (b & 15) : (b >> 4);
}

struct QuantWeight {
  const void* q;
  const float* s;
  const float* m;  // nullptr: no mins
  int64_t N, K, G;
  bool int4;
};

// out[m][n] for rows n in [n0, n1) and M (<= 8) input rows x [M, K]; xsum [M, K/G] (with mins).
template <int M>
static void small_rows(const QuantWeight& w, const float* x, const float* xsum, const float* bias, float* out,
                       int64_t n0, int64_t n1) {
  const int64_t K = w.K, G = w.G, ng = K / G;
  for (int64_t n = n0; n < n1; ++n) {
    const float* s = w.s + n * ng;
    float tot[M] = {};
#ifdef __AVX2__
    __m256 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
#endif
    for (int64_t g = 0; g < ng; ++g) {
      const int64_t k0 = g * G;
      int64_t k = k0;
#ifdef __AVX2__
      __m256 d[M];
      for (int r = 0; r < M; ++r) d[r] = _mm256_setzero_ps();
      if (w.int4) {
        const uint8_t* row = (const uint8_t*)w.q + n * (K / 2);
        const __m128i low = _mm_set1_epi8(15);
        for (; k + 32 <= k0 + G; k += 32) {
          const __m128i v = _mm_loadu_si128((const __m128i*)(row + k / 2));
          const __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
          const __m256 w0 = widen_u8(lo), w1 = widen_u8(_mm_srli_si128(lo, 8));
          const __m256 w2 = widen_u8(hi), w3 = widen_u8(_mm_srli_si128(hi, 8));
          for (int r = 0; r < M; ++r) {
            const float* xr = x + r * K + k;
            d[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), w0, d[r]);
            d[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w1, d[r]);
            d[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w2, d[r]);
            d[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w3, d[r]);
          }
        }
      } else {
        const int8_t* row = (const int8_t*)w.q + n * K;
        for (; k + 8 <= k0 + G; k += 8) {
          const __m256 wv = widen_i8(row + k);
          for (int r = 0; r < M; ++r) d[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), wv, d[r]);
        }
      }
      const __m256 sv = _mm256_set1_ps(s[g]);
      for (int r = 0; r < M; ++r) acc[r] = _mm256_fmadd_ps(d[r], sv, acc[r]);
#endif
      // The group's tail (int8 groups not a multiple of 8; no AVX2: the whole group).
      float t[M] = {};
      for (; k < k0 + G; ++k) {
        const float q = w.int4 ? (float)q4_at((const uint8_t*)w.q + n * (K / 2), k)
                               : (float)((const int8_t*)w.q)[n * K + k];
        for (int r = 0; r < M; ++r) t[r] += x[r * K + k] * q;
      }
      for (int r = 0; r < M; ++r) tot[r] += t[r] * s[g] + (w.m ? w.m[n * ng + g] * xsum[r * ng + g] : 0.f);
    }
    for (int r = 0; r < M; ++r) {
#ifdef __AVX2__
      tot[r] += hsum(acc[r]);
#endif
      out[r * w.N + n] = tot[r] + (bias ? bias[n] : 0.f);
    }
  }
}

constexpr int64_t QBLOCK = 32;      // features per activation scale
constexpr int64_t GEMM_ROWS = 256;  // from this many rows on: dequantise, then one float GEMM

constexpr float QMAX = 32767.f;  // int16 activations

// x [M, K] -> xq [M, K] int16, xd [M, K/32]: q = round(x / d), d = amax / 32767 of each block (0: all 0).
static void quantize_rows(const float* x, int64_t M, int64_t K, int16_t* xq, float* xd) {
  for (int64_t b = 0; b < M * K / QBLOCK; ++b) {
    const float* xb = x + b * QBLOCK;
    float amax = 0.f;
    for (int64_t i = 0; i < QBLOCK; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / QMAX;
    xd[b] = d;
    for (int64_t i = 0; i < QBLOCK; ++i)
      xq[b * QBLOCK + i] = d > 0.f ? (int16_t)std::nearbyint(xb[i] / d) : 0;
  }
}

#ifdef __AVX2__
// The integer kernel: out[m][n] for rows n in [n0, n1); xq, xd from quantize_rows, xsum [M, K/G].
template <int M, bool INT4>
static void small_rows_int(const QuantWeight& w, const int16_t* xq, const float* xd, const float* xsum,
                           const float* bias, float* out, int64_t n0, int64_t n1) {
  const int64_t K = w.K, G = w.G, ng = K / G, nb = K / QBLOCK, bpg = G / QBLOCK;
  const __m128i low = _mm_set1_epi8(15);
  for (int64_t n = n0; n < n1; ++n) {
    const float* s = w.s + n * ng;
    __m256 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0, b = 0; g < ng; ++g) {
      const float sg = s[g];
      for (int64_t e = b + bpg; b < e; ++b) {
        __m256i w0, w1;  // features 0..15 and 16..31 of the block as int16
        if (INT4) {
          const __m128i v = _mm_loadu_si128((const __m128i*)((const uint8_t*)w.q + n * (K / 2) + b * 16));
          w0 = _mm256_cvtepu8_epi16(_mm_and_si128(v, low));
          w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), low));
        } else {
          const int8_t* p = (const int8_t*)w.q + n * K + b * QBLOCK;
          w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p));
          w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(p + 16)));
        }
        for (int r = 0; r < M; ++r) {
          const int16_t* xb = xq + r * K + b * QBLOCK;
          const __m256i x0 = _mm256_loadu_si256((const __m256i*)xb);
          const __m256i x1 = _mm256_loadu_si256((const __m256i*)(xb + 16));
          const __m256 sd = _mm256_set1_ps(sg * xd[r * nb + b]);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_s16(w0, x0, w1, x1)), sd, acc[r]);
        }
      }
    }
    for (int r = 0; r < M; ++r) {
      float mt = 0.f;
      if (w.m)
        for (int64_t g = 0; g < ng; ++g) mt += w.m[n * ng + g] * xsum[r * ng + g];
      out[r * w.N + n] = hsum(acc[r]) + mt + (bias ? bias[n] : 0.f);
    }
  }
}

template <bool INT4>
static void small_rows_int_any(int64_t T, const QuantWeight& w, const int16_t* xq, const float* xd,
                               const float* xsum, const float* bias, float* out, int64_t n0, int64_t n1) {
  switch (T) {
    case 1: small_rows_int<1, INT4>(w, xq, xd, xsum, bias, out, n0, n1); break;
    case 2: small_rows_int<2, INT4>(w, xq, xd, xsum, bias, out, n0, n1); break;
    case 3: small_rows_int<3, INT4>(w, xq, xd, xsum, bias, out, n0, n1); break;
    case 4: small_rows_int<4, INT4>(w, xq, xd, xsum, bias, out, n0, n1); break;
    case 5: small_rows_int<5, INT4>(w, xq, xd, xsum, bias, out, n0, n1); break;
    case 6: small_rows_int<6, INT4>(w, xq, xd, xsum, bias, out, n0, n1); break;
    case 7: small_rows_int<7, INT4>(w, xq, xd, xsum, bias, out, n0, n1); break;
    default: small_rows_int<8, INT4>(w, xq, xd, xsum, bias, out, n0, n1); break;
  }
}
#endif

// Rows [n0, n1) of W as float32 into dst [n1 - n0, K].
static void dequantize_rows(const QuantWeight& w, int64_t n0, int64_t n1, float* dst) {
  const int64_t K = w.K, G = w.G, ng = K / G;
  for (int64_t n = n0; n < n1; ++n) {
    float* o = dst + (n - n0) * K;
    for (int64_t g = 0; g < ng; ++g) {
      const float s = w.s[n * ng + g], m = w.m ? w.m[n * ng + g] : 0.f;
      int64_t k = g * G;
#ifdef __AVX2__
      const __m256 sv = _mm256_set1_ps(s), mv = _mm256_set1_ps(m);
      if (w.int4) {  // whole blocks of 32 (G is a multiple of 32)
        const uint8_t* row = (const uint8_t*)w.q + n * (K / 2);
        const __m128i low = _mm_set1_epi8(15);
        for (; k + 32 <= (g + 1) * G; k += 32) {
          const __m128i v = _mm_loadu_si128((const __m128i*)(row + k / 2));
          const __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
          _mm256_storeu_ps(o + k, _mm256_fmadd_ps(widen_u8(lo), sv, mv));
          _mm256_storeu_ps(o + k + 8, _mm256_fmadd_ps(widen_u8(_mm_srli_si128(lo, 8)), sv, mv));
          _mm256_storeu_ps(o + k + 16, _mm256_fmadd_ps(widen_u8(hi), sv, mv));
          _mm256_storeu_ps(o + k + 24, _mm256_fmadd_ps(widen_u8(_mm_srli_si128(hi, 8)), sv, mv));
        }
      } else {
        const int8_t* row = (const int8_t*)w.q + n * K;
        for (; k + 8 <= (g + 1) * G; k += 8)
          _mm256_storeu_ps(o + k, _mm256_fmadd_ps(widen_i8(row + k), sv, mv));
      }
#endif
      for (; k < (g + 1) * G; ++k) {
        const float q = w.int4 ? (float)q4_at((const uint8_t*)w.q + n * (K / 2), k)
                               : (float)((const int8_t*)w.q)[n * K + k];
        o[k] = q * s + m;
      }
    }
  }
}

static QuantWeight check_weight(const torch::Tensor& q, const torch::Tensor& s, const torch::Tensor& m) {
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && s.dim() == 2 && s.is_contiguous() &&
              s.scalar_type() == torch::kFloat && s.size(0) == q.size(0));
  const bool int4 = q.scalar_type() == torch::kByte;
  TORCH_CHECK(int4 || q.scalar_type() == torch::kChar, "quantized weight: int8 or packed int4 (uint8)");
  const int64_t N = q.size(0), K = int4 ? 2 * q.size(1) : q.size(1), ng = s.size(1);
  TORCH_CHECK(ng >= 1 && K % ng == 0, "scales: one per group of input features");
  const int64_t G = K / ng;
  TORCH_CHECK(!int4 || (K % 32 == 0 && G % 32 == 0), "int4: groups of a multiple of 32 features");
  const bool has_m = m.numel() > 0;
  TORCH_CHECK(!has_m || (m.sizes() == s.sizes() && m.is_contiguous() && m.scalar_type() == torch::kFloat));
  return QuantWeight{q.data_ptr(), s.data_ptr<float>(), has_m ? m.data_ptr<float>() : nullptr, N, K, G, int4};
}

// x [T, K] float32; qweight int8 [N, K] or uint8 [N, K/2] (int4); scales, mins [N, K/G] float32
// (mins may be empty) -> [T, N] float32.
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor mins,
                           c10::optional<torch::Tensor> bias) {
  const QuantWeight w = check_weight(qweight, scales, mins);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.size(1) == w.K);
  TORCH_CHECK(!bias.has_value() || (bias->is_contiguous() && bias->scalar_type() == torch::kFloat));
  x = x.contiguous();
  const int64_t T = x.size(0), N = w.N, K = w.K;
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  auto out = torch::empty({T, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (T <= 8) {
    // Each input row's sum over each group, for the mins.
    std::vector<float> xsum;
    if (w.m) {
      const int64_t ng = K / w.G;
      xsum.assign(T * ng, 0.f);
      for (int64_t r = 0; r < T; ++r)
        for (int64_t k = 0; k < K; ++k) xsum[r * ng + k / w.G] += xp[r * K + k];
    }
#ifdef __AVX2__
    if (w.G % QBLOCK == 0) {
      // Up to 8 rows (the decode loop's, a verification step's): every row's result is
      // independent of the others, so k + 1 verified tokens get the bits of k + 1 one-token
      // steps. (Over blocks of 8 rows for batches of 64 the int8-activation kernel was 40 %
      // slower than the tiles below on AVX2: maddubs + madd + convert + FMA per 32 products is
      // no fewer instructions than float FMAs.)
      std::vector<int16_t> xq(T * K);
      std::vector<float> xd(T * K / QBLOCK);
      quantize_rows(xp, T, K, xq.data(), xd.data());
      at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        if (w.int4)
          small_rows_int_any<true>(T, w, xq.data(), xd.data(), xsum.data(), b, op, n0, n1);
        else
          small_rows_int_any<false>(T, w, xq.data(), xd.data(), xsum.data(), b, op, n0, n1);
      });
      return out;
    }
#endif
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      switch (T) {
        case 1: small_rows<1>(w, xp, xsum.data(), b, op, n0, n1); break;
        case 2: small_rows<2>(w, xp, xsum.data(), b, op, n0, n1); break;
        case 3: small_rows<3>(w, xp, xsum.data(), b, op, n0, n1); break;
        case 4: small_rows<4>(w, xp, xsum.data(), b, op, n0, n1); break;
        case 5: small_rows<5>(w, xp, xsum.data(), b, op, n0, n1); break;
        case 6: small_rows<6>(w, xp, xsum.data(), b, op, n0, n1); break;
        case 7: small_rows<7>(w, xp, xsum.data(), b, op, n0, n1); break;
        default: small_rows<8>(w, xp, xsum.data(), b, op, n0, n1); break;
      }
    });
    return out;
  }
  if (T < GEMM_ROWS) {
    // 9+ rows: each thread dequantises a tile of output rows (~256 KiB, 32-256 rows) into a
    // float32 buffer that stays in cache and multiplies it by torch's GEMM (single-threaded
    // inside); bigger tiles than 32 rows: a quarter of the GEMM calls at K = 576, 8 % faster.
    const int64_t TILE = std::max<int64_t>(32, std::min<int64_t>(256, (int64_t{1} << 16) / K));
    auto out_t = torch::empty({N, T}, x.options());  // [N, T], transposed at the end
    const auto xt = x.t();
    // InferenceMode is thread-local: the pool's threads must see the caller's, or writing into
    // out_t (an inference tensor when the runner made x under inference_mode) is refused.
    const bool inference = c10::InferenceMode::is_enabled();
    at::parallel_for(0, (N + TILE - 1) / TILE, 1, [&](int64_t t0, int64_t t1) {
      c10::InferenceMode guard(inference);
      auto tile = torch::empty({TILE, K}, x.options());
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = t * TILE, n1 = std::min(N, n0 + TILE);
        dequantize_rows(w, n0, n1, tile.data_ptr<float>());
        auto dst = out_t.narrow(0, n0, n1 - n0);
        at::mm_out(dst, tile.narrow(0, 0, n1 - n0), xt);
      }
    });
    out = out_t.t().contiguous();
    if (b) out.add_(*bias);
    return out;
  }
  // Prefill-sized steps: a chunk of output rows dequantised to float32 (rows in parallel, raw
  // stores only), then one GEMM over it with every thread: the dequantisation is amortised over
  // the rows. The chunk (<= 8 MiB) bounds the scratch for the LM head's 49k rows.
  const int64_t chunk = std::max<int64_t>(64, std::min<int64_t>(N, (int64_t{1} << 21) / K));
  auto tile = torch::empty({std::min(chunk, N), K}, x.options());
  float* tp = tile.data_ptr<float>();
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t n1 = std::min(N, n0 + chunk);
    at::parallel_for(n0, n1, 16, [&](int64_t a, int64_t e) { dequantize_rows(w, a, e, tp + (a - n0) * K); });
    auto dst = out.narrow(1, n0, n1 - n0);  // [T, n1 - n0], row stride N
    at::mm_out(dst, x, tile.narrow(0, 0, n1 - n0).t());
  }
  if (b) out.add_(*bias);
  return out;
}

// The whole weight as float32 [N, K] (tests; the tied embedding of a GGUF file).
torch::Tensor quant_dequantize(torch::Tensor qweight, torch::Tensor scales, torch::Tensor mins) {
  const QuantWeight w = check_weight(qweight, scales, mins);
  auto out = torch::empty({w.N, w.K}, scales.options());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, w.N, 64, [&](int64_t n0, int64_t n1) { dequantize_rows(w, n0, n1, op + n0 * w.K); });
  return out;
}

// x [T, K] float32 (K a multiple of 32) -> (q int16 [T, K], d float32 [T, K/32]): the activations
// as the 1-8-row integer kernel sees them (tests build their exact reference from these).
std::tuple<torch::Tensor, torch::Tensor> quant_activations(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.size(1) % QBLOCK == 0);
  x = x.contiguous();
  auto q = torch::empty(x.sizes(), x.options().dtype(torch::kShort));
  auto d = torch::empty({x.size(0), x.size(1) / QBLOCK}, x.options());
  quantize_rows(x.data_ptr<float>(), x.size(0), x.size(1), q.data_ptr<int16_t>(), d.data_ptr<float>());
  return {q, d};
}
