// bfloat16 linear over a weight repacked once at load time into pairs of K per 16 output
// columns (`bf16_pair_pack`), register-blocked over rows x column vectors (`bf16_pair_linear`):
// decode-sized steps (1-64 rows), where oneDNN's packed bf16 linear runs at a third of the
// vdpbf16ps peak. Each weight vector loaded is used by every row of a row block, each input
// pair broadcast against every column vector of the tile; products summed in float32, each
// output rounded once (+ bias) to bfloat16.
//
// The layout, [N, Kp] (Kp: K rounded up to even, the pad column zero): columns in blocks of 16
// (the last block, N % 16 columns, narrower); block b, of width wb, holds for each pair p of K
// its columns' pairs (w[n][2p], w[n][2p + 1]) side by side: element (p, c, j) at
// b 16 Kp + (p wb + c) 2 + j. One pair-row of a block is one 64-byte vector, the operand
// vdpbf16ps takes against a broadcast input pair (bf16_pairs.h).
//
// A row's sum runs over K's pairs in order whatever the row count and the thread count (rows
// are blocked, K blocks pass their float32 sums on exactly, threads split the columns), so a
// row's result does not depend on the rows beside it: a verification step's k + 1 rows equal
// k + 1 one-row steps, bit for bit.
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "cpu_types.h"
#include "ops.h"

namespace {

constexpr int64_t kBlock = 16;    // output columns a block
constexpr int64_t kTileCols = 4;  // the most column blocks one tile (and one task) spans
// Pairs of K a pass over a tile: 4 blocks x 256 x 64 B, 64 KiB of weights, stay in L2 for the
// row blocks after the first.
constexpr int64_t kKBlock = 256;

// Where the tile reads and accumulates: R rows of x (pairs, row stride ldx uint16), C column
// blocks from w (block stride wblock, pair stride wstep, in uint16; `mask`: the columns of a
// narrow last block), float32 sums in acc (row stride kTileCols x kBlock).
struct Tile {
  const uint16_t* x;
  int64_t ldx;
  const uint16_t* w;
  int64_t wblock, wstep, width;  // width: columns of each block (16, or the last block's)
  float* acc;
};

constexpr int64_t kAccLd = kTileCols * kBlock;

#ifdef __AVX512BF16__
constexpr int kMaxRows = 6;  // 6 rows x 4 vectors: 24 accumulators, 4 weights, 1 input pair of 32 registers

template <int R, int C>
static void tile(const Tile& t, int64_t p0, int64_t p1, bool first) {
  const __mmask16 mask = t.width == kBlock ? (__mmask16)0xffff : (__mmask16)((1u << t.width) - 1);
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      acc[r][c] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(t.acc + r * kAccLd + c * kBlock);
  for (int64_t p = p0; p < p1; ++p) {
    __m512bh wv[C];
    for (int c = 0; c < C; ++c)
      wv[c] = (__m512bh)_mm512_maskz_loadu_epi32(mask, t.w + c * t.wblock + p * t.wstep);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, t.x + r * t.ldx + 2 * p, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv[c], xv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(t.acc + r * kAccLd + c * kBlock, acc[r][c]);
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kMaxRows = 4;  // 4 rows x 16 columns (2 vectors): 8 accumulators, 4 widened weights, 2 inputs

// The pairs widened to float32: the low half of each 32-bit lane is w[n][2p], the high w[n][2p + 1].
template <int R, int C>
static void tile(const Tile& t, int64_t p0, int64_t p1, bool first) {
  static_assert(C == 1, "AVX2 tiles span one block");
  const __m256i hi_mask = _mm256_set1_epi32((int)0xffff0000u);
  __m256i lanes[2];  // which of the 16 columns exist (a narrow last block)
  for (int h = 0; h < 2; ++h) {
    alignas(32) int32_t m[8];
    for (int i = 0; i < 8; ++i) m[i] = h * 8 + i < t.width ? -1 : 0;
    lanes[h] = _mm256_load_si256((const __m256i*)m);
  }
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h)
      acc[r][h] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(t.acc + r * kAccLd + h * 8);
  for (int64_t p = p0; p < p1; ++p) {
    __m256 we[2], wo[2];
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_maskload_epi32((const int*)(t.w + p * t.wstep) + h * 8, lanes[h]);
      we[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      wo[h] = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));
    }
    for (int r = 0; r < R; ++r) {
      const __m256 xe = _mm256_set1_ps(bf2f(t.x[r * t.ldx + 2 * p]));
      const __m256 xo = _mm256_set1_ps(bf2f(t.x[r * t.ldx + 2 * p + 1]));
      for (int h = 0; h < 2; ++h)
        acc[r][h] = _mm256_fmadd_ps(xo, wo[h], _mm256_fmadd_ps(xe, we[h], acc[r][h]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(t.acc + r * kAccLd + h * 8, acc[r][h]);
}
#else
constexpr int kMaxRows = 1;

template <int R, int C>
static void tile(const Tile& t, int64_t p0, int64_t p1, bool first) {
  for (int c = 0; c < C; ++c)
    for (int64_t n = 0; n < t.width; ++n) {
      float s = first ? 0.f : t.acc[c * kBlock + n];
      for (int64_t p = p0; p < p1; ++p) {
        const uint16_t* w = t.w + c * t.wblock + p * t.wstep + 2 * n;
        s += bf2f(t.x[2 * p]) * bf2f(w[0]) + bf2f(t.x[2 * p + 1]) * bf2f(w[1]);
      }
      t.acc[c * kBlock + n] = s;
    }
}
#endif

#if defined(__AVX512BF16__)
constexpr int64_t kMaxCols = kTileCols;
#else
constexpr int64_t kMaxCols = 1;
#endif

// tile<R, C> for R in [1, kMaxRows], C in [1, kMaxCols], chosen at run time.
template <int R = kMaxRows>
static void tile_rows(int64_t rows, int64_t cols, const Tile& t, int64_t p0, int64_t p1, bool first) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<R - 1>(rows, cols, t, p0, p1, first);
  }
  switch (cols) {
    case 1: return tile<R, 1>(t, p0, p1, first);
#if defined(__AVX512BF16__)
    case 2: return tile<R, 2>(t, p0, p1, first);
    case 3: return tile<R, 3>(t, p0, p1, first);
    default: return tile<R, 4>(t, p0, p1, first);
#endif
  }
}

}  // namespace

// w [N, K] bfloat16 -> [N, Kp] in the pair layout above (Kp = K rounded up to even).
torch::Tensor bf16_pair_pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16, "bf16_pair_pack: a 2-D bfloat16 weight");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), Kp = (K + 1) / 2 * 2, P = Kp / 2;
  auto out = torch::empty({N, Kp}, w.options());
  const uint16_t* src = bf_ptr(w);
  uint16_t* dst = bf_mut(out);
  at::parallel_for(0, (N + kBlock - 1) / kBlock, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kBlock, wb = std::min(kBlock, N - n0);
      uint16_t* blk = dst + n0 * Kp;
      for (int64_t p = 0; p < P; ++p)
        for (int64_t c = 0; c < wb; ++c)
          for (int64_t j = 0; j < 2; ++j) {
            const int64_t k = 2 * p + j;
            blk[(p * wb + c) * 2 + j] = k < K ? src[(n0 + c) * K + k] : 0;
          }
    }
  });
  return out;
}

// x [M, K] bfloat16 (any M), packed [N, Kp] from bf16_pair_pack -> x w^T (+ bias) [M, N] bfloat16.
torch::Tensor bf16_pair_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 &&
              packed.scalar_type() == torch::kBFloat16);
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0), Kp = packed.size(1), P = Kp / 2;
  TORCH_CHECK(packed.is_contiguous() && Kp == (K + 1) / 2 * 2, "bf16_pair_linear: packed is not x's K");
  TORCH_CHECK(!bias.has_value() ||
              (bias->scalar_type() == torch::kBFloat16 && bias->is_contiguous() && bias->numel() == N));
  // The input pairs read as 32-bit words: rows of Kp values (an odd K padded with a zero).
  x = K == Kp ? x.contiguous() : torch::constant_pad_nd(x, {0, 1});
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const uint16_t* xp = bf_ptr(x);
  const uint16_t* wp = bf_ptr(packed);
  const uint16_t* bp = bias.has_value() ? bf_ptr(*bias) : nullptr;
  uint16_t* op = bf_mut(out);
  const int64_t full = N / kBlock, blocks = (N + kBlock - 1) / kBlock;
  // A task: up to `cols` whole blocks, or the narrow last block alone; fewer columns a task
  // where there are few blocks a thread.
  const int64_t cols = std::clamp<int64_t>(full / std::max(1, at::get_num_threads()), 1, kMaxCols);
  const int64_t tasks = (full + cols - 1) / cols + (blocks > full ? 1 : 0);
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> acc(M * kAccLd);  // [M, kAccLd] the float32 sums of a task's columns
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task * cols;
      const bool narrow = b >= full;
      const int64_t nb = narrow ? 1 : std::min(cols, full - b), n0 = narrow ? full * kBlock : b * kBlock;
      const int64_t width = narrow ? N - n0 : kBlock;
      for (int64_t p0 = 0; p0 < P; p0 += kKBlock) {
        const int64_t p1 = std::min(P, p0 + kKBlock);
        for (int64_t m = 0; m < M; m += kMaxRows) {
          const Tile t{xp + m * Kp, Kp, wp + n0 * Kp, kBlock * Kp, 2 * width, width, acc.data() + m * kAccLd};
          tile_rows(std::min<int64_t>(kMaxRows, M - m), nb, t, p0, p1, p0 == 0);
        }
      }
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < nb * width; ++n)
          op[m * N + n0 + n] = f2bf(acc[m * kAccLd + n] + (bp ? bf2f(bp[n0 + n]) : 0.f));
    }
  });
  return out;
}
