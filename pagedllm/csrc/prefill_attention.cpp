// Paged attention for prefill chunks on the CPU, flash-attention style: K and V read straight
// from the cache's pages through the block table, the output written in place into the step's
// [T, H, D] output (see attention/cpu_kernels.py).
//
// One task = (request, KV head, tile of BQ query tokens). Its R = BQ x G rows (the G query
// heads sharing the KV head, for each token; padded to whole vectors) are held transposed,
// Qt [D][R] float32 (pre-scaled), so that every product is a broadcast of one K or V element
// times a vector of R rows: S^T [keys][R] = K Qt, O^T [D][R] += V^T P^T. The rows' running max,
// sum and rescaling are then plain vector ops (online softmax, float32), and each K / V tile,
// widened to float32 once, serves all G heads of all BQ tokens. A bfloat16 cache is not widened
// where AVX512-BF16 multiplies bfloat16 pairs: S^T = K Qt on the query's and the keys' own pairs
// (qk_bf16), and O [R][D] += P V with the weights rounded to bfloat16 and the tile's value rows
// interleaved two by two into pairs of each column (pv_bf16), float32 sums. Key tiles run from the first
// key any row's window reaches to the last row's own position (causal with the chunk's offset:
// query i of a chunk over c cached tokens is at position c + i); only the tiles that cross the
// diagonal or the window's edge are masked.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "bf16_pairs.h"
#include "cpu_types.h"
#include "cpu_vec.h"
#include "ops.h"

namespace {

// The broadcast rows of a micro-tile (AB x 4 accumulators of the 32 / 16 registers), and the
// causal / window mask of each vector width (cpu_vec.h's vec).
#if defined(__AVX512F__)
constexpr int AB = 4;
// s where key position kp is visible from the rows' positions qpos (kp <= qpos, and
// kp > qpos - w when w > 0), -inf elsewhere.
inline vec vmask(vec s, vec qpos, float kp, float w) {
  __mmask16 m = _mm512_cmp_ps_mask(vset(kp), qpos, _CMP_GT_OQ);
  if (w > 0) m |= _mm512_cmp_ps_mask(vset(kp), vsub(qpos, vset(w)), _CMP_LE_OQ);
  return _mm512_mask_blend_ps(m, s, vset(-std::numeric_limits<float>::infinity()));
}
// p, zero where s is -inf (a masked score: exp's clamp would leave e^-87)
inline vec vkeep(vec p, vec s) {
  return _mm512_maskz_mov_ps(
      _mm512_cmp_ps_mask(s, vset(-std::numeric_limits<float>::infinity()), _CMP_NEQ_OQ), p);
}
#elif defined(CPU_VEC_SIMD)
constexpr int AB = 2;
inline vec vmask(vec s, vec qpos, float kp, float w) {
  vec m = _mm256_cmp_ps(vset(kp), qpos, _CMP_GT_OQ);
  if (w > 0) m = _mm256_or_ps(m, _mm256_cmp_ps(vset(kp), vsub(qpos, vset(w)), _CMP_LE_OQ));
  return _mm256_blendv_ps(s, vset(-std::numeric_limits<float>::infinity()), m);
}
inline vec vkeep(vec p, vec s) {
  return _mm256_and_ps(p, _mm256_cmp_ps(s, vset(-std::numeric_limits<float>::infinity()), _CMP_NEQ_OQ));
}
#else
constexpr int AB = 1;
inline vec vmask(vec s, vec qpos, float kp, float w) {
  return kp > qpos || (w > 0 && kp <= qpos - w) ? -std::numeric_limits<float>::infinity() : s;
}
inline vec vkeep(vec p, vec s) { return s == -std::numeric_limits<float>::infinity() ? 0.f : p; }
#endif

constexpr int64_t ROWS = 64;  // target rows (query tokens x G heads) a task: 4 AVX-512 vectors
constexpr int64_t BK = 32;    // keys a tile

// C[a][r] = C[a][r] * alpha[r] (alpha null: 0) + sum_c A(a, c) B[c][r], for AB rows a and NR
// vectors of r; A(a, c) = A[a * as + c * cs] is broadcast, B's and C's rows are R floats apart.
template <int NR>
inline void micro_tile(const float* A, int64_t as, int64_t cs, const float* B, int64_t nc, float* C,
                       int64_t R, const float* alpha) {
  vec acc[AB][NR];
  for (int r = 0; r < NR; ++r) {
    const vec al = alpha ? vld(alpha + r * VL) : vzero();
    for (int a = 0; a < AB; ++a) acc[a][r] = alpha ? vmul(vld(C + a * R + r * VL), al) : vzero();
  }
  for (int64_t c = 0; c < nc; ++c) {
    vec b[NR];
    for (int r = 0; r < NR; ++r) b[r] = vld(B + c * R + r * VL);
    for (int a = 0; a < AB; ++a) {
      const vec x = vset(A[a * as + c * cs]);
      for (int r = 0; r < NR; ++r) acc[a][r] = vfma(x, b[r], acc[a][r]);
    }
  }
  for (int a = 0; a < AB; ++a)
    for (int r = 0; r < NR; ++r) vst(C + a * R + r * VL, acc[a][r]);
}

// micro_tile over na rows of C (a multiple of AB) and nrv vectors of R = nrv * VL floats.
void gemm_rows(const float* A, int64_t as, int64_t cs, int64_t na, const float* B, int64_t nc, float* C,
               int64_t nrv, const float* alpha) {
  const int64_t R = nrv * VL;
  for (int64_t a = 0; a < na; a += AB)
    for (int64_t r = 0; r < nrv;) {
      const float* Ab = A + a * as;
      const float* Bb = B + r * VL;
      float* Cb = C + a * R + r * VL;
      const float* al = alpha ? alpha + r * VL : nullptr;
      switch (std::min<int64_t>(nrv - r, 4)) {
        case 4:
          micro_tile<4>(Ab, as, cs, Bb, nc, Cb, R, al);
          r += 4;
          break;
        case 3:
          micro_tile<3>(Ab, as, cs, Bb, nc, Cb, R, al);
          r += 3;
          break;
        case 2:
          micro_tile<2>(Ab, as, cs, Bb, nc, Cb, R, al);
          r += 2;
          break;
        default:
          micro_tile<1>(Ab, as, cs, Bb, nc, Cb, R, al);
          r += 1;
          break;
      }
    }
}

#ifdef __AVX512BF16__
// S^T [AB keys][NR vectors of rows] = K Q^T on bfloat16 pairs: vdpbf16ps multiplies 32 pairs
// exactly and adds them into 16 float32 lanes, half the instructions of widening to float32.
// krows[a]: key a's row as D / 2 pairs (straight from the cache page); Q2 [nc = D / 2][R] pairs.
template <int NR>
inline void qk_bf16_tile(const uint32_t* const* krows, const uint32_t* Q2, int64_t nc, float* C, int64_t R) {
  __m512 acc[AB][NR];
  for (int a = 0; a < AB; ++a)
    for (int r = 0; r < NR; ++r) acc[a][r] = vzero();
  for (int64_t c = 0; c < nc; ++c) {
    __m512bh b[NR];
    for (int r = 0; r < NR; ++r) b[r] = (__m512bh)_mm512_loadu_si512(Q2 + c * R + r * VL);
    for (int a = 0; a < AB; ++a) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32((int)krows[a][c]);
      for (int r = 0; r < NR; ++r) acc[a][r] = _mm512_dpbf16_ps(acc[a][r], x, b[r]);
    }
  }
  for (int a = 0; a < AB; ++a)
    for (int r = 0; r < NR; ++r) vst(C + a * R + r * VL, acc[a][r]);
}

void qk_bf16(const uint32_t* const* krows, int64_t na, const uint32_t* Q2, int64_t nc, float* C,
             int64_t nrv) {
  const int64_t R = nrv * VL;
  for (int64_t a = 0; a < na; a += AB)
    for (int64_t r = 0; r < nrv;) {
      float* Cb = C + a * R + r * VL;
      switch (std::min<int64_t>(nrv - r, 4)) {
        case 4:
          qk_bf16_tile<4>(krows + a, Q2 + r * VL, nc, Cb, R);
          r += 4;
          break;
        case 3:
          qk_bf16_tile<3>(krows + a, Q2 + r * VL, nc, Cb, R);
          r += 3;
          break;
        case 2:
          qk_bf16_tile<2>(krows + a, Q2 + r * VL, nc, Cb, R);
          r += 2;
          break;
        default:
          qk_bf16_tile<1>(krows + a, Q2 + r * VL, nc, Cb, R);
          r += 1;
          break;
      }
    }
}
// O [AB rows][NR vectors of D] = O * alpha[row] + P V on bfloat16 pairs: P2 [nc][R] holds each
// row's weights of keys 2c, 2c + 1 as a pair (broadcast), V2 [nc][D] those keys' values as
// pairs of each column (bf16_pairs.h); O's rows are D floats apart.
template <int NR>
inline void pv_bf16_tile(const uint32_t* P2, int64_t R, const uint32_t* V2, int64_t D, int64_t nc, float* O,
                         const float* alpha) {
  __m512 acc[AB][NR];
  for (int a = 0; a < AB; ++a) {
    const __m512 al = vset(alpha[a]);
    for (int r = 0; r < NR; ++r) acc[a][r] = vmul(vld(O + a * D + r * VL), al);
  }
  for (int64_t c = 0; c < nc; ++c) {
    __m512bh b[NR];
    for (int r = 0; r < NR; ++r) b[r] = (__m512bh)_mm512_loadu_si512(V2 + c * D + r * VL);
    for (int a = 0; a < AB; ++a) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32((int)P2[c * R + a]);
      for (int r = 0; r < NR; ++r) acc[a][r] = _mm512_dpbf16_ps(acc[a][r], x, b[r]);
    }
  }
  for (int a = 0; a < AB; ++a)
    for (int r = 0; r < NR; ++r) vst(O + a * D + r * VL, acc[a][r]);
}

// pv_bf16_tile over the R rows (a multiple of AB) and D columns (a multiple of VL).
void pv_bf16(const uint32_t* P2, int64_t R, const uint32_t* V2, int64_t D, int64_t nc, float* O,
             const float* alpha) {
  const int64_t ndv = D / VL;
  for (int64_t a = 0; a < R; a += AB)
    for (int64_t r = 0; r < ndv;) {
      const uint32_t* Vb = V2 + r * VL;
      float* Ob = O + a * D + r * VL;
      switch (std::min<int64_t>(ndv - r, 4)) {
        case 4:
          pv_bf16_tile<4>(P2 + a, R, Vb, D, nc, Ob, alpha + a);
          r += 4;
          break;
        case 3:
          pv_bf16_tile<3>(P2 + a, R, Vb, D, nc, Ob, alpha + a);
          r += 3;
          break;
        case 2:
          pv_bf16_tile<2>(P2 + a, R, Vb, D, nc, Ob, alpha + a);
          r += 2;
          break;
        default:
          pv_bf16_tile<1>(P2 + a, R, Vb, D, nc, Ob, alpha + a);
          r += 1;
          break;
      }
    }
}
// P^T [n][R] float32 weights -> P2 [(n + 1) / 2][R]: keys (2c, 2c + 1) of each row as a pair,
// rounded to bfloat16; an odd n's last pair with a zero weight.
void weight_pairs(const float* s, int64_t n, int64_t R, uint32_t* P2) {
  for (int64_t c = 0; 2 * c < n; ++c)
    for (int64_t r = 0; r < R; r += VL) {
      const float* s0 = s + 2 * c * R + r;
      _mm512_storeu_si512(P2 + c * R + r, bf16_pack_pairs(vld(s0), 2 * c + 1 < n ? vld(s0 + R) : vzero()));
    }
}
constexpr bool BF16_DOT = true;
#else
constexpr bool BF16_DOT = false;
void qk_bf16(const uint32_t* const*, int64_t, const uint32_t*, int64_t, float*, int64_t) {}
void pv_bf16(const uint32_t*, int64_t, const uint32_t*, int64_t, int64_t, float*, const float*) {}
inline void bf16_pair_rows(const uint16_t*, const uint16_t*, int64_t, uint32_t*) {}
void weight_pairs(const float*, int64_t, int64_t, uint32_t*) {}
#endif

// Element T of q and out (float, uint16_t bfloat16 bits, c10::Half), C of the caches: T, or
// bfloat16 under float32 queries (a 16-bit cache of a float32 model, each row widened exactly).
template <typename T, typename C = T>
struct Step {
  const T* q;
  const C* k;
  const C* v;
  T* out;
  int64_t q_tok, q_head, ks, vs, khs, vhs, H, G, D, block_size, NB;
  const int32_t *q_start, *q_len, *seq_len, *tables;
  float scale;
  int64_t window, BQ;
};

// Per-thread buffers, R rows at most.
struct Scratch {
  std::vector<float> qt, o, s, kf, vf, m, l, alpha, qpos;
  std::vector<uint32_t> zero;          // a key row of zeros (bfloat16 pairs), for padding keys
  std::vector<uint32_t> p2, v2;        // the tile's weights and values as key pairs (pv_bf16)
  std::vector<const uint32_t*> krows;  // the tile's key rows in the cache (bfloat16 pairs)
  Scratch(int64_t D, int64_t R)
      : qt(D * R),
        o(D * R),
        s(BK * R),
        kf(BK * D),
        vf(BK * D),
        m(R),
        l(R),
        alpha(R),
        qpos(R),
        zero(D / 2),
        p2(BK / 2 * R),
        v2(BK / 2 * D),
        krows(BK) {}
};

// The cache slot of key position kp of a request (block table bt).
template <typename T, typename C>
inline int64_t slot(const Step<T, C>& st, const int32_t* bt, int64_t kp) {
  return (int64_t)bt[kp / st.block_size] * st.block_size + kp % st.block_size;
}

// Widen key / value rows [j0, j0 + n) of KV head h of a request (block table bt) into float32
// rows of D.
template <typename T, typename C>
void gather_rows(const Step<T, C>& st, const C* base, int64_t stride, const int32_t* bt, int64_t j0,
                 int64_t n, float* dst) {
  for (int64_t j = 0; j < n; ++j) {
    const int64_t kp = j0 + j;
    const C* row = base + slot(st, bt, kp) * stride;
    float* d = dst + j * st.D;
    for (int64_t c = 0; c < st.D; c += VL) vst(d + c, vload(row + c));
  }
}

template <typename T, typename C>
void prefill_task(const Step<T, C>& st, int64_t p, int64_t h, int64_t i0, Scratch& sc) {
  // A bfloat16 model's K Q^T on bfloat16 pairs (Qt then holds q's own pairs, unscaled: the
  // scale is applied to the float32 scores).
  constexpr bool DOT = BF16_DOT && std::is_same<T, uint16_t>::value && std::is_same<C, uint16_t>::value;
  const int64_t D = st.D, G = st.G, ql = st.q_len[p], ctx = st.seq_len[p] - ql;
  const int64_t nq = std::min(st.BQ, ql - i0), rows = nq * G, nrv = (rows + VL - 1) / VL, R = nrv * VL;
  const int32_t* bt = st.tables + p * st.NB;
  float *qt = sc.qt.data(), *o = sc.o.data(), *s = sc.s.data(), *kf = sc.kf.data(), *vf = sc.vf.data();
  // Qt [D][R]: row r = token i0 + r / G, head h * G + r % G; padding rows are zero and sit at the
  // last token's position (their output is never written).
  uint32_t* qt2 = reinterpret_cast<uint32_t*>(qt);  // DOT: [D / 2][R] pairs
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = std::min(r / G, nq - 1);
    const T* qr = st.q + (st.q_start[p] + i0 + i) * st.q_tok + (h * G + r % G) * st.q_head;
    if constexpr (DOT)
      for (int64_t c = 0; c < D / 2; ++c)
        qt2[c * R + r] = r < rows ? reinterpret_cast<const uint32_t*>(qr)[c] : 0;
    else
      for (int64_t d = 0; d < D; ++d) qt[d * R + r] = r < rows ? to_f(qr[d]) * st.scale : 0.f;
    sc.qpos[r] = (float)(ctx + i0 + i);
    sc.m[r] = -1e30f;  // finite: exp(m - m_new) of a row whose keys were all masked so far is 1, not NaN
    sc.l[r] = 0.f;
  }
  std::fill(o, o + D * R, 0.f);
  const int64_t first = ctx + i0, last = ctx + i0 + nq - 1;  // the rows' positions
  const int64_t w = st.window;
  const int64_t k_lo = w > 0 ? std::max(first - w + 1, (int64_t)0) : 0;
  const C* kh = st.k + h * st.khs;
  const C* vh = st.v + h * st.vhs;
  for (int64_t j0 = k_lo; j0 <= last; j0 += BK) {
    const int64_t n = std::min(BK, last + 1 - j0), npad = (n + AB - 1) / AB * AB;
    if constexpr (DOT) {
      for (int64_t j = 0; j < npad; ++j) {
        const int64_t kp = j0 + j;
        sc.krows[j] =
            j < n ? reinterpret_cast<const uint32_t*>(kh + slot(st, bt, kp) * st.ks) : sc.zero.data();
      }
      qk_bf16(sc.krows.data(), npad, qt2, D / 2, s, nrv);  // S^T [npad][R], unscaled
    } else {
      gather_rows(st, kh, st.ks, bt, j0, n, kf);
      std::fill(kf + n * D, kf + npad * D, 0.f);
      gemm_rows(kf, D, 1, npad, qt, D, s, nrv, nullptr);  // S^T [npad][R]
    }
    if constexpr (DOT)
      for (int64_t c = 0; 2 * c < n; ++c) {  // keys (2c, 2c + 1) as pairs; an odd tile's last with zeros
        const uint16_t* a = vh + slot(st, bt, j0 + 2 * c) * st.vs;
        const uint16_t* b = 2 * c + 1 < n ? vh + slot(st, bt, j0 + 2 * c + 1) * st.vs
                                          : reinterpret_cast<const uint16_t*>(sc.zero.data());
        bf16_pair_rows(a, b, D, sc.v2.data() + c * D);
      }
    else
      gather_rows(st, vh, st.vs, bt, j0, n, vf);
    // Padding keys (>= n) lie past the last row's position: the causal mask removes them.
    const bool masked = j0 + npad - 1 > first || (w > 0 && j0 <= last - w);
    for (int64_t rv = 0; rv < nrv; ++rv) {
      const vec qpos = vld(sc.qpos.data() + rv * VL);
      vec mx = vld(sc.m.data() + rv * VL);
      const vec m_old = mx;
      for (int64_t j = 0; j < npad; ++j) {
        float* sj = s + j * R + rv * VL;
        vec x = vld(sj);
        if constexpr (DOT) x = vmul(x, vset(st.scale));
        if (masked) x = vmask(x, qpos, (float)(j0 + j), (float)w);
        if (DOT || masked) vst(sj, x);
        mx = vmax(mx, x);
      }
      const vec alpha = vexp(vsub(m_old, mx));
      vec sum = vzero();
      for (int64_t j = 0; j < n; ++j) {
        float* sj = s + j * R + rv * VL;
        const vec x = vld(sj);
        vec e = vexp(vsub(x, mx));
        if (masked) e = vkeep(e, x);
        vst(sj, e);
        sum = vadd(sum, e);
      }
      vst(sc.m.data() + rv * VL, mx);
      vst(sc.alpha.data() + rv * VL, alpha);
      vst(sc.l.data() + rv * VL, vfma(vld(sc.l.data() + rv * VL), alpha, sum));
    }
    if constexpr (DOT) {
      const int64_t nc = (n + 1) / 2;
      weight_pairs(s, n, R, sc.p2.data());
      pv_bf16(sc.p2.data(), R, sc.v2.data(), D, nc, o, sc.alpha.data());  // O [R][D] = alpha O + P V
    } else {
      gemm_rows(vf, 1, D, D, s, n, o, nrv, sc.alpha.data());  // O^T [D][R] = O^T alpha + V^T P^T
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* out = st.out + ((st.q_start[p] + i0 + r / G) * st.H + h * G + r % G) * D;
    const float inv = 1.f / sc.l[r];
    for (int64_t d = 0; d < D; ++d) out[d] = from_f<T>((DOT ? o[r * D + d] : o[d * R + r]) * inv);
  }
}

template <typename T, typename C = T>
void run_prefill(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                 torch::Tensor& out, const torch::Tensor& q_start, const torch::Tensor& q_len,
                 const torch::Tensor& seq_lens, const torch::Tensor& block_table, int64_t block_size,
                 double scale, int64_t window) {
  const int64_t H = q.size(1), D = q.size(2), Hkv = k_cache.size(1), G = H / Hkv, P = q_len.size(0);
  const int64_t BQ = std::max<int64_t>(1, ROWS / G);
  // clang-format off: Step's fields in its order
  const Step<T, C> st{reinterpret_cast<const T*>(q.data_ptr()), reinterpret_cast<const C*>(k_cache.data_ptr()),
                      reinterpret_cast<const C*>(v_cache.data_ptr()), reinterpret_cast<T*>(out.data_ptr()),
                   q.stride(0), q.stride(1), k_cache.stride(0), v_cache.stride(0), k_cache.stride(1),
                   v_cache.stride(1), H, G, D, block_size, block_table.size(1), q_start.data_ptr<int32_t>(),
                   q_len.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), block_table.data_ptr<int32_t>(),
                   (float)scale, window, BQ};
  // clang-format on
  // Tasks (request, query tile, KV head), the longest (most keys) first, taken one at a time
  // by whichever thread is free: a causal chunk's last tiles cost many times its first.
  struct Item {
    int64_t keys, p, i0, h;
  };
  std::vector<Item> items;
  for (int64_t p = 0; p < P; ++p) {
    const int64_t ql = st.q_len[p], ctx = st.seq_len[p] - ql;
    for (int64_t i0 = 0; i0 < ql; i0 += BQ) {
      const int64_t last = ctx + std::min(i0 + BQ, ql) - 1;
      const int64_t keys = last + 1 - (window > 0 ? std::max(ctx + i0 - window + 1, (int64_t)0) : 0);
      for (int64_t h = 0; h < Hkv; ++h) items.push_back({keys, p, i0, h});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.keys > b.keys; });
  const int64_t R = (BQ * G + VL - 1) / VL * VL;
  std::atomic<int64_t> next{0};
  const int64_t n_items = (int64_t)items.size();
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n_items), 1, [&](int64_t begin, int64_t end) {
    Scratch sc(D, R);
    for (int64_t t; (t = next.fetch_add(1)) < n_items;)
      prefill_task<T, C>(st, items[t].p, items[t].h, items[t].i0, sc);
  });
}

}  // namespace

// q [T, H, D] (any token / head strides, unit element stride); caches [S, Hkv, D] of q's dtype
// (float32, bfloat16 or float16; slot = block * block_size + offset), already holding this
// step's K/V; out [T, H, D] contiguous, q's dtype. The P prefill chunks: q_start [P] (first token
// in the step), q_len [P], seq_lens [P] (cached + new tokens), block_table [P, NB], all int32.
// Writes each chunk's rows of out; the other rows are left as they are. window > 0: a query at
// position i attends to keys (i - window, i] only (the blocks before are never read).
void paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor out,
                   torch::Tensor q_start, torch::Tensor q_len, torch::Tensor seq_lens,
                   torch::Tensor block_table, int64_t block_size, double scale, int64_t window) {
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == torch::kFloat || dt == torch::kBFloat16 || dt == torch::kHalf,
              "paged_prefill: q must be float32, bfloat16 or float16, got ", dt);
  const auto ct = k_cache.scalar_type();
  TORCH_CHECK((ct == dt || (dt == torch::kFloat && ct == torch::kBFloat16)) && v_cache.scalar_type() == ct &&
                  out.scalar_type() == dt,
              "paged_prefill: out must have q's dtype, the caches q's or (float32 q) bfloat16");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3 && out.dim() == 3);
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1 && out.is_contiguous());
  TORCH_CHECK(out.sizes() == q.sizes() && k_cache.size(2) == q.size(2) && v_cache.sizes() == k_cache.sizes());
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0,
              "paged_prefill: num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(q.size(2) % VL == 0, "paged_prefill: head_dim must be a multiple of ", VL);
  for (const auto* t : {&q_start, &q_len, &seq_lens, &block_table})
    TORCH_CHECK(t->scalar_type() == torch::kInt && t->is_contiguous(), "paged_prefill: int32 metadata");
  TORCH_CHECK(q_start.size(0) == q_len.size(0) && seq_lens.size(0) == q_len.size(0) &&
              block_table.size(0) == q_len.size(0));
  if (dt == torch::kFloat && ct == torch::kBFloat16)
    run_prefill<float, uint16_t>(q, k_cache, v_cache, out, q_start, q_len, seq_lens, block_table, block_size,
                                 scale, window);
  else if (dt == torch::kFloat)
    run_prefill<float>(q, k_cache, v_cache, out, q_start, q_len, seq_lens, block_table, block_size, scale,
                       window);
  else if (dt == torch::kBFloat16)
    run_prefill<uint16_t>(q, k_cache, v_cache, out, q_start, q_len, seq_lens, block_table, block_size, scale,
                          window);
  else
    run_prefill<c10::Half>(q, k_cache, v_cache, out, q_start, q_len, seq_lens, block_table, block_size, scale,
                           window);
}
