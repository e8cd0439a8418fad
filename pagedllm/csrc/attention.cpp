// Paged attention for decode steps on the CPU: K and V read straight from the cache's pages
// through the block table (see attention/cpu_kernels.py).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_types.h"
#include "kv_quant.h"
#include "ops.h"

// One (request, KV head): the G query heads that share the KV head, over keys [start, L)
// (W = L - start of them; start > 0 in a sliding window) reached through the block table; the
// entries before start's block are never read (a sliding-window request frees those blocks).
// k, v point at this KV head of slot 0; ks / vs are slot strides. T is the cache's element:
// float, uint16_t holding bfloat16 bits, or a quantized element (kv_quant.h) whose per-token
// scales ksc / vsc (this KV head of slot 0, slot stride ss) fold into the score and the softmax
// weight. q and out are float32.
template <typename T>
struct Task {
  const float* q;
  const T* k;
  const T* v;
  const int32_t* blocks;
  int64_t start, L, W, block_size, ks, vs, G, D;
  float scale;
  float* scores;
  float* out;
  const float* ksc;
  const float* vsc;
  int64_t ss;
};

// The dequantisation factor of key / value row j of physical block b (1 for a float cache).
template <typename T>
static inline float row_scale(const Task<T>& t, const float* sc, int64_t b, int64_t j) {
  if constexpr (is_quantized_kv<T>()) return sc[(b * t.block_size + j) * t.ss];
  return 1.f;
}

static void softmax_rows(float* s, int64_t G, int64_t L);

// Portable path: any D, any CPU.
template <typename T>
static void decode_task_scalar(const Task<T>& t) {
  for (int64_t blk = t.start / t.block_size, t0 = blk * t.block_size; t0 < t.L; t0 += t.block_size, ++blk) {
    const int64_t j0 = std::max(t.start - t0, (int64_t)0), n = std::min(t.block_size, t.L - t0);
    const T* kb = t.k + (int64_t)t.blocks[blk] * t.block_size * t.ks;
    for (int64_t j = j0; j < n; ++j)
      for (int64_t g = 0; g < t.G; ++g) {
        float s = 0.f;
        for (int64_t d = 0; d < t.D; ++d) s += t.q[g * t.D + d] * to_f(kb[j * t.ks + d]);
        t.scores[g * t.W + t0 + j - t.start] = s * t.scale * row_scale(t, t.ksc, t.blocks[blk], j);
      }
  }
  softmax_rows(t.scores, t.G, t.W);
  std::fill(t.out, t.out + t.G * t.D, 0.f);
  for (int64_t blk = t.start / t.block_size, t0 = blk * t.block_size; t0 < t.L; t0 += t.block_size, ++blk) {
    const int64_t j0 = std::max(t.start - t0, (int64_t)0), n = std::min(t.block_size, t.L - t0);
    const T* vb = t.v + (int64_t)t.blocks[blk] * t.block_size * t.vs;
    for (int64_t j = j0; j < n; ++j)
      for (int64_t g = 0; g < t.G; ++g) {
        const float p = t.scores[g * t.W + t0 + j - t.start] * row_scale(t, t.vsc, t.blocks[blk], j);
        for (int64_t d = 0; d < t.D; ++d) t.out[g * t.D + d] += p * to_f(vb[j * t.vs + d]);
      }
  }
}

#ifdef __AVX512F__
// Blocks sit anywhere in the cache, so no hardware prefetcher runs ahead across a block
// boundary: ask for block blk + 1's rows of this head while block blk is being read.
template <typename T>
static inline void prefetch_block(const Task<T>& t, const T* base, int64_t blk, int64_t stride) {
  const int64_t t0 = blk * t.block_size;
  if (t0 >= t.L) return;
  const int64_t n = std::min(t.block_size, t.L - t0);
  constexpr int64_t E = sizeof(T);
  const char* b = (const char*)(base + (int64_t)t.blocks[blk] * t.block_size * stride);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t c = 0; c < t.D * E; c += 64) _mm_prefetch(b + j * stride * E + c, _MM_HINT_T0);
}

// ND = D / 16 vectors a head row. Scores: each key row is loaded once into registers and
// dotted with the G query heads. Output: GN heads at a time accumulate in registers while
// the value rows stream past once.
template <int ND, int GN, typename T>
static void pv_heads(const Task<T>& t, int64_t g0) {
  __m512 acc[GN][ND];
  for (int gi = 0; gi < GN; ++gi)
    for (int c = 0; c < ND; ++c) acc[gi][c] = _mm512_setzero_ps();
  prefetch_block(t, t.v, t.start / t.block_size, t.vs);
  for (int64_t blk = t.start / t.block_size, t0 = blk * t.block_size; t0 < t.L; t0 += t.block_size, ++blk) {
    const int64_t j0 = std::max(t.start - t0, (int64_t)0), n = std::min(t.block_size, t.L - t0);
    const T* vb = t.v + (int64_t)t.blocks[blk] * t.block_size * t.vs;
    prefetch_block(t, t.v, blk + 1, t.vs);
    for (int64_t j = j0; j < n; ++j) {
      const T* v = vb + j * t.vs;
      __m512 vv[ND];
      for (int c = 0; c < ND; ++c) vv[c] = load16(v + 16 * c);
      const float vscale = row_scale(t, t.vsc, t.blocks[blk], j);
      for (int gi = 0; gi < GN; ++gi) {
        const __m512 p = _mm512_set1_ps(t.scores[(g0 + gi) * t.W + t0 + j - t.start] * vscale);
        for (int c = 0; c < ND; ++c) acc[gi][c] = _mm512_fmadd_ps(p, vv[c], acc[gi][c]);
      }
    }
  }
  for (int gi = 0; gi < GN; ++gi)
    for (int c = 0; c < ND; ++c) _mm512_storeu_ps(t.out + (g0 + gi) * t.D + 16 * c, acc[gi][c]);
}

template <int ND, typename T>
static void decode_task_avx512(const Task<T>& t) {
  prefetch_block(t, t.k, t.start / t.block_size, t.ks);
  for (int64_t blk = t.start / t.block_size, t0 = blk * t.block_size; t0 < t.L; t0 += t.block_size, ++blk) {
    const int64_t j0 = std::max(t.start - t0, (int64_t)0), n = std::min(t.block_size, t.L - t0);
    const T* kb = t.k + (int64_t)t.blocks[blk] * t.block_size * t.ks;
    prefetch_block(t, t.k, blk + 1, t.ks);
    for (int64_t j = j0; j < n; ++j) {
      __m512 kv[ND];
      for (int c = 0; c < ND; ++c) kv[c] = load16(kb + j * t.ks + 16 * c);
      const float kscale = t.scale * row_scale(t, t.ksc, t.blocks[blk], j);
      for (int64_t g = 0; g < t.G; ++g) {
        const float* qg = t.q + g * t.D;
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), kv[0]);
        for (int c = 1; c < ND; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), kv[c], acc);
        t.scores[g * t.W + t0 + j - t.start] = _mm512_reduce_add_ps(acc) * kscale;
      }
    }
  }
  softmax_rows(t.scores, t.G, t.W);
  constexpr int GMAX = ND >= 8 ? 1 : 8 / ND;  // keep GN x ND accumulators within 16 registers
  int64_t g = 0;
  for (; g + GMAX <= t.G; g += GMAX) pv_heads<ND, GMAX, T>(t, g);
  for (; g < t.G; ++g) pv_heads<ND, 1, T>(t, g);
}
#endif

static void softmax_rows(float* s, int64_t G, int64_t L) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * L;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < L; ++i) m = sg[i] > m ? sg[i] : m;
    float sum = 0.f;
    int64_t i = 0;
#ifdef __AVX512F__
    __m512 vsum = _mm512_setzero_ps();
    const __m512 vm = _mm512_set1_ps(m);
    for (; i + 16 <= L; i += 16) {
      const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sg + i), vm));
      _mm512_storeu_ps(sg + i, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    sum = _mm512_reduce_add_ps(vsum);
#endif
    for (; i < L; ++i) {
      sg[i] = std::exp(sg[i] - m);
      sum += sg[i];
    }
    const float inv = 1.f / sum;
    for (i = 0; i < L; ++i) sg[i] *= inv;
  }
}

template <typename T>
static void decode_task(const Task<T>& t) {
#ifdef __AVX512F__
  if (t.D == 64) return decode_task_avx512<4, T>(t);
  if (t.D == 128) return decode_task_avx512<8, T>(t);
  if (t.D == 256) return decode_task_avx512<16, T>(t);  // Gemma 3
#endif
  decode_task_scalar<T>(t);
}

// q [B, H, D] contiguous of element Q (float, or uint16_t bfloat16 bits), caches [S, Hkv, D] of
// element C (Q itself, or a quantized element with scales [S, Hkv] float32) -> out [B, H, D] of Q.
// bfloat16: each task widens its G query rows into a float32 buffer and rounds its float32
// output once.
template <typename Q, typename C>
static torch::Tensor run_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                torch::Tensor block_table, torch::Tensor seq_lens, int64_t block_size,
                                double scale, int64_t window, const float* ksc, const float* vsc) {
  constexpr bool F32 = std::is_same<Q, float>::value;
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  const int64_t G = H / Hkv, NB = block_table.size(1);
  auto out = torch::empty_like(q);
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_table.data_ptr<int32_t>();
  const int64_t max_len = B ? *std::max_element(sl, sl + B) : 0;
  const Q* qp = reinterpret_cast<const Q*>(q.data_ptr());
  Q* op = reinterpret_cast<Q*>(out.data_ptr());
  const C* kp = reinterpret_cast<const C*>(k_cache.data_ptr());
  const C* vp = reinterpret_cast<const C*>(v_cache.data_ptr());
  const int64_t ks = k_cache.stride(0), vs = v_cache.stride(0);    // slot strides
  const int64_t khs = k_cache.stride(1), vhs = v_cache.stride(1);  // head strides
  const float fscale = (float)scale;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * max_len);
    std::vector<float> qbuf(F32 ? 0 : G * D), obuf(F32 ? 0 : G * D);  // [G, D] bfloat16 only
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / Hkv, h = idx % Hkv;
      const Q* qt = qp + (b * H + h * G) * D;
      Q* ot = op + (b * H + h * G) * D;
      const float* qf;
      float* of;
      if constexpr (F32) {
        qf = qt;
        of = ot;
      } else {
        for (int64_t i = 0; i < G * D; ++i) qbuf[i] = to_f(qt[i]);
        qf = qbuf.data();
        of = obuf.data();
      }
      // clang-format off: Task's fields in its order, not one a line
      const int64_t start = window > 0 ? std::max(sl[b] - window, (int64_t)0) : 0;
      const Task<C> t{qf, kp + h * khs, vp + h * vhs, tables + b * NB, start, sl[b], sl[b] - start,
                      block_size, ks, vs, G, D, fscale, scores.data(), of,
                      ksc ? ksc + h : nullptr, vsc ? vsc + h : nullptr, Hkv};
      // clang-format on
      decode_task<C>(t);
      if constexpr (!F32)
        for (int64_t i = 0; i < G * D; ++i) ot[i] = f2bf(obuf[i]);
    }
  });
  return out;
}

// The cache's element C for a query of element Q.
template <typename Q>
static torch::Tensor decode_by_cache(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_table, torch::Tensor seq_lens, int64_t block_size,
                                     double scale, int64_t window,
                                     const c10::optional<torch::Tensor>& k_scale,
                                     const c10::optional<torch::Tensor>& v_scale) {
  const auto dt = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == dt);
  const bool quant = dt == torch::kChar || dt == torch::kFloat8_e4m3fn || dt == torch::kFloat8_e5m2;
  TORCH_CHECK(quant == (k_scale.has_value() && v_scale.has_value()), "scales go with an int8 / fp8 cache");
  if (!quant) {
    TORCH_CHECK(q.scalar_type() == dt);
    return run_decode<Q, Q>(q, k_cache, v_cache, block_table, seq_lens, block_size, scale, window, nullptr,
                            nullptr);
  }
  const int64_t S = k_cache.size(0), Hkv = k_cache.size(1);
  for (const auto* sc : {&*k_scale, &*v_scale})
    TORCH_CHECK(sc->scalar_type() == torch::kFloat && sc->is_contiguous() && sc->size(0) == S &&
                sc->size(1) == Hkv);
  const float* ksc = k_scale->data_ptr<float>();
  const float* vsc = v_scale->data_ptr<float>();
  if (dt == torch::kChar)
    return run_decode<Q, int8_t>(q, k_cache, v_cache, block_table, seq_lens, block_size, scale, window, ksc,
                                 vsc);
  if (dt == torch::kFloat8_e4m3fn)
    return run_decode<Q, Fp8E4M3>(q, k_cache, v_cache, block_table, seq_lens, block_size, scale, window, ksc,
                                  vsc);
  return run_decode<Q, Fp8E5M2>(q, k_cache, v_cache, block_table, seq_lens, block_size, scale, window, ksc,
                                vsc);
}

// q [B, H, D], caches [S, Hkv, D] (slot = block * block_size + offset), block_table [B, NB] int32,
// seq_lens [B] int32 -> out [B, H, D]. float32, or bfloat16 (q and out; computed in float32); the
// caches of q's dtype, or int8 / fp8 with k_scale / v_scale [S, Hkv] float32 (value = element x
// its token's scale). window > 0: a sliding-window layer, each query attends to its last
// `window` keys only.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_table, torch::Tensor seq_lens, int64_t block_size,
                           double scale, int64_t window, c10::optional<torch::Tensor> k_scale,
                           c10::optional<torch::Tensor> v_scale) {
  TORCH_CHECK(k_cache.stride(2) == 1 && v_cache.stride(2) == 1);
  if (q.scalar_type() == torch::kBFloat16)
    return decode_by_cache<uint16_t>(q.contiguous(), k_cache, v_cache, block_table, seq_lens, block_size,
                                     scale, window, k_scale, v_scale);
  TORCH_CHECK(q.scalar_type() == torch::kFloat);
  return decode_by_cache<float>(q.contiguous(), k_cache, v_cache, block_table, seq_lens, block_size, scale,
                                window, k_scale, v_scale);
}
