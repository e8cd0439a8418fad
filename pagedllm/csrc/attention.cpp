// Paged attention for decode steps on the CPU: K and V read straight from the cache's pages
// through the block table (see attention/cpu_kernels.py).
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_types.h"
#include "cpu_vec.h"
#include "kv_quant.h"
#include "ops.h"

// One (request, KV head): the G query heads that share the KV head, over keys [start, L)
// (W = L - start of them; start > 0 in a sliding window) reached through the block table; the
// entries before start's block are never read (a sliding-window request frees those blocks).
// k, v point at this KV head of slot 0; ks / vs are slot strides. T is the cache's element:
// float, uint16_t holding bfloat16 bits, c10::Half, or a quantized element (kv_quant.h) whose per-token
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
  bool q_pairs;  // q holds bfloat16 values (a bfloat16 model's): exact as bfloat16 pairs
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

#ifdef CPU_VEC_SIMD
// prefetcht0 as an asm statement: GCC 12 -O3 emitted none of the _mm_prefetch calls of these
// loops (objdump of the build).
static inline void prefetch_row(const char* p) { asm volatile("prefetcht0 %0" : : "m"(*p)); }

// Blocks sit anywhere in the cache, so no hardware prefetcher runs ahead across a block
// boundary: ask for this head's rows of the blocks ahead while one is being read.
template <typename T>
static inline void prefetch_block(const Task<T>& t, const T* base, int64_t blk, int64_t stride) {
  const int64_t t0 = blk * t.block_size;
  if (t0 >= t.L) return;
  const int64_t n = std::min(t.block_size, t.L - t0);
  constexpr int64_t E = sizeof(T);
  const char* b = (const char*)(base + (int64_t)t.blocks[blk] * t.block_size * stride);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t c = 0; c < t.D * E; c += 64) prefetch_row(b + j * stride * E + c);
}

// Rows asked for ahead of the one being read. A task reads a block for all its heads before the
// next (decode_heads_vec), so one block ahead is the task's whole slots of it, 12-16 KiB at
// 3-8 KV heads: more in flight only queues on L1's miss buffers (64 rows ahead, or into L2
// with prefetcht1, read 0.70-0.95x as fast on a Zen 5).
constexpr int64_t PREFETCH_ROWS = 16;

template <typename T>
static inline int64_t prefetch_distance(const Task<T>& t) {
  return std::max<int64_t>(1, PREFETCH_ROWS / t.block_size);
}

// The task's K blocks then its V blocks as one sequence i = 0, 1, ...: the scores' pass asks
// for the first value blocks as it nears its end.
template <typename T>
static inline void prefetch_kv(const Task<T>& t, int64_t i) {
  const int64_t first = t.start / t.block_size, n = (t.L - 1) / t.block_size - first + 1;
  if (i < n)
    prefetch_block(t, t.k, first + i, t.ks);
  else if (i < 2 * n)
    prefetch_block(t, t.v, first + i - n, t.vs);
}

// Output accumulators held in registers: at most ACC_REGS vectors (of the 32 AVX-512 / 16 AVX2
// registers), in column runs of at most COL_VECS vectors of a head row.
#ifdef __AVX512F__
constexpr int ACC_REGS = 24, COL_VECS = 16;
#else
constexpr int ACC_REGS = 12, COL_VECS = 8;
#endif

// ND = D / VL vectors a head row. Output columns [c0, c0 + CW) vectors of GN heads from g0
// accumulate in registers while block blk's value rows stream past: each row widened once for
// the GN heads; the first block starts from zero, later ones from the sums in t.out.
template <int ND, int CW, int GN, typename T>
static void pv_heads(const Task<T>& t, int64_t g0, int c0, int64_t blk) {
  const int64_t first = t.start / t.block_size, nblk = (t.L - 1) / t.block_size - first + 1;
  vec acc[GN][CW];
  for (int gi = 0; gi < GN; ++gi)
    for (int c = 0; c < CW; ++c)
      acc[gi][c] = blk == first ? vzero() : vld(t.out + (g0 + gi) * t.D + VL * (c0 + c));
  const int64_t t0 = blk * t.block_size;
  const int64_t j0 = std::max(t.start - t0, (int64_t)0), n = std::min(t.block_size, t.L - t0);
  const T* vb = t.v + (int64_t)t.blocks[blk] * t.block_size * t.vs + VL * c0;
  prefetch_kv(t, nblk + blk - first + prefetch_distance(t));
  for (int64_t j = j0; j < n; ++j) {
    const T* v = vb + j * t.vs;
    vec vv[CW];
    for (int c = 0; c < CW; ++c) vv[c] = vload(v + VL * c);
    const float vscale = row_scale(t, t.vsc, t.blocks[blk], j);
    for (int gi = 0; gi < GN; ++gi) {
      const vec p = vset(t.scores[(g0 + gi) * t.W + t0 + j - t.start] * vscale);
      for (int c = 0; c < CW; ++c) acc[gi][c] = vfma(p, vv[c], acc[gi][c]);
    }
  }
  for (int gi = 0; gi < GN; ++gi)
    for (int c = 0; c < CW; ++c) vst(t.out + (g0 + gi) * t.D + VL * (c0 + c), acc[gi][c]);
}

// The last rem (< N + 1) heads from g in one pass.
template <int ND, int CW, int N, typename T>
static void pv_rest(const Task<T>& t, int64_t g, int64_t rem, int c0, int64_t blk) {
  if constexpr (N >= 1) {
    if (rem == N) return pv_heads<ND, CW, N, T>(t, g, c0, blk);
    pv_rest<ND, CW, N - 1, T>(t, g, rem, c0, blk);
  }
}

// Scores of query head g against rows k[0..n) (1 <= n <= VL, row stride ks) -> lanes 0..n-1,
// before the scale: one accumulator a key row (in registers: the VL are unrolled; lanes past n
// repeat row n - 1, for the caller's partial store), reduced together by vsum_lanes.
template <int ND, typename T>
static inline vec qk_rows(const float* q, const T* k, int64_t ks, int64_t n) {
  vec acc[VL];
  for (int j = 0; j < VL; ++j) {
    const T* row = k + std::min<int64_t>(j, n - 1) * ks;
    acc[j] = vmul(vld(q), vload(row));
    for (int c = 1; c < ND; ++c) acc[j] = vfma(vld(q + VL * c), vload(row + VL * c), acc[j]);
  }
  return vsum_lanes(acc);
}

#ifndef __AVX512F__
// Scores of GN query heads (q: the first one's row, head stride D) against rows k[0..n) (1 <= n
// <= 8) -> s[g], row i in lane i: qk_rows' sums in qk_rows' order, but each chunk of a key row
// is widened (a 16-bit or quantized cache) once for the GN heads, 4 rows at a time so that the
// accumulators fit AVX2's 16 registers. A float32 cache keeps qk_rows: its loads are the FMAs'
// operands, nothing to share, and this loop measured 1.04x its time.
template <int ND, int GN, typename T>
static inline void qk_heads(const float* q, int64_t D, const T* k, int64_t ks, int64_t n, vec* s) {
  vec u[2][GN];
  for (int h = 0; h < 2; ++h) {
    vec acc[GN][4];
    for (int e = 0; e < 4; ++e) {
      const T* row = k + std::min<int64_t>(4 * h + e, n - 1) * ks;
      const vec k0 = vload(row);
      for (int g = 0; g < GN; ++g) acc[g][e] = vmul(vld(q + g * D), k0);
      for (int c = 1; c < ND; ++c) {
        const vec kc = vload(row + VL * c);
        for (int g = 0; g < GN; ++g) acc[g][e] = vfma(vld(q + g * D + VL * c), kc, acc[g][e]);
      }
    }
    for (int g = 0; g < GN; ++g) u[h][g] = vsum_lanes4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
  }
  for (int g = 0; g < GN; ++g) s[g] = vsum_halves(u[0][g], u[1][g]);
}

constexpr int QK_HEADS = 3;  // heads a pass over a tile's key rows: 12 accumulators

// The scores of heads [g, G) over the tile of n rows at k (into the scores' column col), N heads
// a pass while N are left, then fewer.
template <int ND, int N, typename T>
static inline void qk_tile(const Task<T>& t, const T* k, int64_t n, int64_t g, vec scale, int64_t col) {
  if constexpr (N >= 1) {
    for (; g + N <= t.G; g += N) {
      vec s[N];
      qk_heads<ND, N, T>(t.q + g * t.D, t.D, k, t.ks, n, s);
      for (int i = 0; i < N; ++i) vst_first(t.scores + (g + i) * t.W + col, vmul(s[i], scale), n);
    }
    qk_tile<ND, N - 1, T>(t, k, n, g, scale, col);
  }
}
#endif

#ifdef __AVX512BF16__
// bfloat16 cache: the query's pairs (exact: a bfloat16 model's query is bfloat16) against the
// rows' pairs straight from the page, vdpbf16ps, no widening of the keys.
template <int ND>
static inline __m512 qk_rows_bf16(const __m512bh* q2, const uint16_t* k, int64_t ks, int64_t n) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) {
    const uint16_t* row = k + std::min<int64_t>(j, n - 1) * ks;
    acc[j] = _mm512_setzero_ps();
    for (int c = 0; c < ND / 2; ++c)
      acc[j] = _mm512_dpbf16_ps(acc[j], q2[c], (__m512bh)_mm512_loadu_si512(row + 32 * c));
  }
  return vsum_lanes(acc);
}
#endif

// The query's pairs for vdpbf16ps (a bfloat16 cache under a bfloat16 model's query, exact): the
// first 8 heads', ND / 2 vectors each; Gp = 0 where the rows are widened instead.
template <int ND, typename T>
struct QueryPairs {
#ifdef __AVX512BF16__
  static constexpr bool BF16 = std::is_same<T, uint16_t>::value;
  __m512bh q2[BF16 ? 8 * ND / 2 : 1];
  int64_t Gp;
  explicit QueryPairs(const Task<T>& t) : Gp(BF16 && t.q_pairs ? std::min<int64_t>(t.G, 8) : 0) {
    for (int64_t g = 0; g < Gp; ++g)
      for (int c = 0; c < ND / 2; ++c)
        q2[g * ND / 2 + c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(t.q + g * t.D + 32 * c + 16),
                                                 _mm512_loadu_ps(t.q + g * t.D + 32 * c));
  }
#else
  explicit QueryPairs(const Task<T>&) {}
#endif
};

// The scores of block blk's keys (those from t.start on) for t's G query heads, before the
// softmax: a tile of VL keys at a time, each key row loaded once and dotted with the G heads.
template <int ND, typename T>
static void qk_block(const Task<T>& t, const QueryPairs<ND, T>& qp, int64_t blk) {
  const int64_t t0 = blk * t.block_size;
  const int64_t j0 = std::max(t.start - t0, (int64_t)0), n = std::min(t.block_size, t.L - t0);
  const T* kb = t.k + (int64_t)t.blocks[blk] * t.block_size * t.ks;
  for (int64_t j = j0; j < n; j += VL) {
    const int64_t m = std::min<int64_t>(VL, n - j);
    vec scale = vset(t.scale);
    if constexpr (is_quantized_kv<T>()) {
      alignas(64) float rs[VL] = {};
      for (int64_t i = 0; i < m; ++i) rs[i] = row_scale(t, t.ksc, t.blocks[blk], j + i);
      scale = vmul(scale, vld(rs));
    }
#ifndef __AVX512F__
    if constexpr (!std::is_same<T, float>::value) {
      qk_tile<ND, QK_HEADS, T>(t, kb + j * t.ks, m, 0, scale, t0 + j - t.start);
      continue;
    }
#endif
    for (int64_t g = 0; g < t.G; ++g) {
      vec s;
#ifdef __AVX512BF16__
      if constexpr (QueryPairs<ND, T>::BF16)
        s = g < qp.Gp ? qk_rows_bf16<ND>(qp.q2 + g * ND / 2, kb + j * t.ks, t.ks, m)
                      : qk_rows<ND, T>(t.q + g * t.D, kb + j * t.ks, t.ks, m);
      else
#endif
        s = qk_rows<ND, T>(t.q + g * t.D, kb + j * t.ks, t.ks, m);
      vst_first(t.scores + g * t.W + t0 + j - t.start, vmul(s, scale), m);
    }
  }
}

// The tasks of KV heads ts[0..nh) of one request (one block table, one context): the scores over
// the keys, the softmax, then the values' pass in register tiles of heads x columns. Each pass
// takes a block for all nh heads before the next block: the block's slots (every head of the
// task side by side, contiguous in the cache) are read from memory together, where one head's
// rows alone are short runs a slot apart (a 1B model's 8 heads: 128 of every 1,024 bytes).
template <int ND, typename T>
static void decode_heads_vec(const Task<T>* ts, int64_t nh) {
  const Task<T>& t = ts[0];
  const int64_t first = t.start / t.block_size, last = t.L > t.start ? (t.L - 1) / t.block_size + 1 : first;
  const int64_t pd = prefetch_distance(t);
  for (int64_t h = 0; h < nh; ++h)
    for (int64_t i = 0; i < pd; ++i) prefetch_kv(ts[h], i);
  for (int64_t blk = first; blk < last; ++blk)
    for (int64_t h = 0; h < nh; ++h) {
      prefetch_kv(ts[h], blk - first + pd);
      // the query's pairs made each block stay in registers (an array of each head's, made once
      // a task, read 0.90-0.98x as fast)
      qk_block<ND, T>(ts[h], QueryPairs<ND, T>(ts[h]), blk);
    }
  for (int64_t h = 0; h < nh; ++h) softmax_rows(ts[h].scores, t.G, t.W);
  if (last == first)  // no keys: zero outputs
    for (int64_t h = 0; h < nh; ++h) std::fill(ts[h].out, ts[h].out + t.G * t.D, 0.f);
  constexpr int CW = ND < COL_VECS ? ND : COL_VECS;
  constexpr int GMAX = ACC_REGS / CW > 1 ? ACC_REGS / CW : 1;
  for (int64_t blk = first; blk < last; ++blk)
    for (int64_t h = 0; h < nh; ++h)
      for (int c0 = 0; c0 < ND; c0 += CW) {
        int64_t g = 0;
        for (; g + GMAX <= t.G; g += GMAX) pv_heads<ND, CW, GMAX, T>(ts[h], g, c0, blk);
        pv_rest<ND, CW, GMAX - 1, T>(ts[h], g, t.G - g, c0, blk);
      }
}
#endif

static void softmax_rows(float* s, int64_t G, int64_t L) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * L;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < L; ++i) m = sg[i] > m ? sg[i] : m;
    vec vsum = vzero();
    const vec vm = vset(m);
    int64_t i = 0;
    for (; i + VL <= L; i += VL) {
      const vec e = vexp(vsub(vld(sg + i), vm));
      vst(sg + i, e);
      vsum = vadd(vsum, e);
    }
    float sum = vreduce(vsum);
    for (; i < L; ++i) {
      sg[i] = std::exp(sg[i] - m);
      sum += sg[i];
    }
    const float inv = 1.f / sum;
    for (i = 0; i < L; ++i) sg[i] *= inv;
  }
}

template <typename T>
static void decode_heads(const Task<T>* ts, int64_t nh) {
#ifdef CPU_VEC_SIMD
  const int64_t D = ts[0].D;
  if (D == 64) return decode_heads_vec<64 / VL, T>(ts, nh);
  if (D == 128) return decode_heads_vec<128 / VL, T>(ts, nh);
  if (D == 256) return decode_heads_vec<256 / VL, T>(ts, nh);  // Gemma 3
#endif
  for (int64_t h = 0; h < nh; ++h) decode_task_scalar<T>(ts[h]);
}

// q [B, H, D] of element Q (float, uint16_t bfloat16 bits or c10::Half; heads dense, rows
// strided), caches [S, Hkv, D] of element C (Q itself, bfloat16 under a float32 Q, or a quantized
// element with scales [S, Hkv] float32) -> out [B, H, D] of Q (heads dense, rows strided). 16-bit Q: each
// task widens its heads' query rows into a float32 buffer and rounds its float32 output once.
template <typename Q, typename C>
static void run_decode(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                       const torch::Tensor& block_table, const torch::Tensor& seq_lens, int64_t block_size,
                       double scale, int64_t window, const float* ksc, const float* vsc,
                       const torch::Tensor& out) {
  constexpr bool F32 = std::is_same<Q, float>::value;
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  const int64_t G = H / Hkv, NB = block_table.size(1), qrs = q.stride(0), ors = out.stride(0);
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
  // A task: KV heads [h0, h0 + hg) of one request, hg the most heads (a divisor of Hkv) that
  // still leaves two tasks a thread, so that a step of several requests reads whole slots,
  // contiguous in the cache, where one head's rows are short runs apart (~1.4x the read rate
  // at 16 requests of a 1B model's 8 heads). Tasks claimed in turn: contexts differ in length.
  const int64_t threads = at::get_num_threads();
  int64_t hg = Hkv;
  while (hg > 1 && (Hkv % hg != 0 || B * (Hkv / hg) < 2 * threads)) --hg;
  const int64_t groups = Hkv / hg, tasks = B * groups;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> scores(hg * G * max_len);
    std::vector<float> qbuf(F32 ? 0 : hg * G * D), obuf(F32 ? 0 : hg * G * D);  // [hg G, D] 16-bit only
    std::vector<Task<C>> ts;
    for (int64_t idx; (idx = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      const int64_t b = idx / groups, h0 = idx % groups * hg;
      const Q* qt = qp + b * qrs + h0 * G * D;
      Q* ot = op + b * ors + h0 * G * D;
      const float* qf;
      float* of;
      if constexpr (F32) {
        qf = qt;
        of = ot;
      } else {
        for (int64_t i = 0; i < hg * G * D; ++i) qbuf[i] = to_f(qt[i]);
        qf = qbuf.data();
        of = obuf.data();
      }
      const int64_t start = window > 0 ? std::max(sl[b] - window, (int64_t)0) : 0;
      ts.clear();
      for (int64_t i = 0; i < hg; ++i) {
        const int64_t h = h0 + i;
        // clang-format off: Task's fields in its order, not one a line
        ts.push_back({qf + i * G * D, kp + h * khs, vp + h * vhs, tables + b * NB, start, sl[b], sl[b] - start,
                      block_size, ks, vs, G, D, fscale, scores.data() + i * G * max_len, of + i * G * D,
                      ksc ? ksc + h : nullptr, vsc ? vsc + h : nullptr, Hkv, std::is_same<Q, uint16_t>::value});
        // clang-format on
      }
      decode_heads<C>(ts.data(), hg);
      if constexpr (!F32)
        for (int64_t i = 0; i < hg * G * D; ++i) ot[i] = from_f<Q>(obuf[i]);
    }
  });
}

// The cache's element C for a query of element Q.
template <typename Q>
static void decode_by_cache(const torch::Tensor& q, const torch::Tensor& k_cache,
                            const torch::Tensor& v_cache, const torch::Tensor& block_table,
                            const torch::Tensor& seq_lens, int64_t block_size, double scale, int64_t window,
                            const c10::optional<torch::Tensor>& k_scale,
                            const c10::optional<torch::Tensor>& v_scale, const torch::Tensor& out) {
  const auto dt = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == dt);
  const bool quant = dt == torch::kChar || dt == torch::kFloat8_e4m3fn || dt == torch::kFloat8_e5m2;
  TORCH_CHECK(quant == (k_scale.has_value() && v_scale.has_value()), "scales go with an int8 / fp8 cache");
  if (!quant && std::is_same<Q, float>::value && dt == torch::kBFloat16)  // a float32 model's 16-bit cache
    return run_decode<float, uint16_t>(q, k_cache, v_cache, block_table, seq_lens, block_size, scale, window,
                                       nullptr, nullptr, out);
  if (!quant) {
    TORCH_CHECK(q.scalar_type() == dt, "paged_decode: the caches of q's dtype, or (float32 q) bfloat16");
    return run_decode<Q, Q>(q, k_cache, v_cache, block_table, seq_lens, block_size, scale, window, nullptr,
                            nullptr, out);
  }
  const int64_t S = k_cache.size(0), Hkv = k_cache.size(1);
  for (const auto* sc : {&*k_scale, &*v_scale})
    TORCH_CHECK(sc->scalar_type() == torch::kFloat && sc->is_contiguous() && sc->size(0) == S &&
                sc->size(1) == Hkv);
  const float* ksc = k_scale->data_ptr<float>();
  const float* vsc = v_scale->data_ptr<float>();
  if (dt == torch::kChar)
    return run_decode<Q, int8_t>(q, k_cache, v_cache, block_table, seq_lens, block_size, scale, window, ksc,
                                 vsc, out);
  if (dt == torch::kFloat8_e4m3fn)
    return run_decode<Q, Fp8E4M3>(q, k_cache, v_cache, block_table, seq_lens, block_size, scale, window, ksc,
                                  vsc, out);
  return run_decode<Q, Fp8E5M2>(q, k_cache, v_cache, block_table, seq_lens, block_size, scale, window, ksc,
                                vsc, out);
}

// q [B, H, D], caches [S, Hkv, D] (slot = block * block_size + offset), block_table [B, NB] int32,
// seq_lens [B] int32 -> out [B, H, D]. float32, bfloat16 or float16 (q and out; computed in float32);
// the caches of q's dtype, bfloat16 under a float32 q, or (float32 / bfloat16 q) int8 / fp8 with
// k_scale / v_scale [S, Hkv] float32
// (value = element x its token's scale). window > 0: a sliding-window layer, each query attends to its last
// `window` keys only. paged_decode_into: into `out` instead (rows may be strided in q and out, as
// the columns of a few heads in a wider row).
void paged_decode_into(torch::Tensor q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                       const torch::Tensor& block_table, const torch::Tensor& seq_lens, int64_t block_size,
                       double scale, int64_t window, const c10::optional<torch::Tensor>& k_scale,
                       const c10::optional<torch::Tensor>& v_scale, const torch::Tensor& out) {
  TORCH_CHECK(k_cache.stride(2) == 1 && v_cache.stride(2) == 1);
  const int64_t D = q.size(2);
  if (q.stride(2) != 1 || q.stride(1) != D) q = q.contiguous();  // rows may be strided, heads dense
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.stride(2) == 1 &&
                  out.stride(1) == D,
              "paged_decode: out [B, H, D] of q's dtype, heads dense");
  if (q.scalar_type() == torch::kBFloat16)
    return decode_by_cache<uint16_t>(q, k_cache, v_cache, block_table, seq_lens, block_size, scale, window,
                                     k_scale, v_scale, out);
  if (q.scalar_type() == torch::kHalf) {  // a float16 cache only (no int8 / fp8 beside it)
    TORCH_CHECK(k_cache.scalar_type() == torch::kHalf && v_cache.scalar_type() == torch::kHalf &&
                    !k_scale.has_value() && !v_scale.has_value(),
                "a float16 query takes a float16 cache");
    return run_decode<c10::Half, c10::Half>(q, k_cache, v_cache, block_table, seq_lens, block_size, scale,
                                            window, nullptr, nullptr, out);
  }
  TORCH_CHECK(q.scalar_type() == torch::kFloat);
  decode_by_cache<float>(q, k_cache, v_cache, block_table, seq_lens, block_size, scale, window, k_scale,
                         v_scale, out);
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_table, torch::Tensor seq_lens, int64_t block_size,
                           double scale, int64_t window, c10::optional<torch::Tensor> k_scale,
                           c10::optional<torch::Tensor> v_scale) {
  auto out = torch::empty(q.sizes(), q.options());
  paged_decode_into(q, k_cache, v_cache, block_table, seq_lens, block_size, scale, window, k_scale, v_scale,
                    out);
  return out;
}
