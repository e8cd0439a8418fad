// bfloat16 linear over a weight repacked once at load time into pairs of K per 16 output
// columns (`bf16_pair_pack`), register-blocked over rows x column vectors (`bf16_pair_linear`):
// decode-sized steps (1-32 rows), where oneDNN's packed bf16 linear reads the weights at ~70 %
// of the machine's rate (AVX512-BF16), and every size where oneDNN has no bf16 kernels (AVX2).
// Each weight vector loaded is used by every row of a row tile, each input pair broadcast
// against every column vector of the tile; products summed in float32, each output rounded once
// (+ bias) to bfloat16.
//
// The layout, [N, Kp] (Kp: K rounded up to even, the pad column zero): columns in blocks of 16
// (the last block, N % 16 columns, narrower); block b, of width wb, holds for each pair p of K
// its columns' pairs (w[n][2p], w[n][2p + 1]) side by side: element (p, c, j) at
// b 16 Kp + (p wb + c) 2 + j. One pair-row of a block is one 64-byte vector, the operand
// vdpbf16ps takes against a broadcast input pair (bf16_pairs.h).
//
// The input is repacked a call into row tiles of pairs, [P, R] a tile: one pair of every row of
// the tile side by side, so a step's broadcasts read one cache line (rows K apart, 4 KiB at K =
// 2048, would all fall in one L1 set).
//
// A row's sum runs over K's pairs in order whatever the row count and the thread count (rows
// are tiled, K blocks pass their float32 sums on exactly, threads split the columns), so a
// row's result does not depend on the rows beside it: a verification step's k + 1 rows equal
// k + 1 one-row steps, bit for bit.
#include <ATen/Parallel.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "cpu_types.h"
#include "ops.h"

namespace {

constexpr int64_t kBlock = 16;  // output columns a block

// Where a tile reads and accumulates: its R rows' pairs (repacked: pair p of row r at x[2 (p R + r)]),
// column blocks from w (block stride wblock, pair stride wstep, in uint16; `width`: the columns
// of each block, 16 or the narrow last block's), float32 sums in acc (row stride ldacc).
struct Tile {
  const uint16_t* x;
  const uint16_t* w;
  int64_t wblock, wstep, width;
  float* acc;
  int64_t ldacc;
};

#ifdef __AVX512BF16__
// A tile is R rows x C column blocks, R C float32 accumulators in registers (at most 30, with C
// weight vectors and a broadcast input pair: 32 registers). Up to 30 rows take one tile, so a
// decode step reads each weight vector from memory once and uses it R times: at 16 rows one
// core's weight stream (~30 GB/s) and its vdpbf16ps rate (~500 GFLOP/s) meet; 17-30 rows (one
// block, a broadcast a row a step) run at ~90 % of that rate while the two cores' streams stay
// under the machine's read rate, where tiles of 8 rows over K blocks read the weights from
// memory once and then again from the caches for each further tile (~1.3x at 24 rows, the 1B
// shape). More rows take tiles of 8 x 3 blocks (8 loads a step for 24 vdpbf16ps, where 16 x 1
// takes 17 for 16) over K blocks whose weights stay in L1 between the row tiles.
constexpr int kMaxRows = 30;
constexpr int kGemmRows = 8;
// Pairs ahead (8 KiB a block) a tile of 3 rows or more prefetches its weights (16 rows: ~21 ->
// ~25 GB/s a core; 8 rows ~1.7x on 2 threads); at 1-2 rows (8 blocks at once) it gains nothing.
constexpr int64_t kPrefetch = 128;
constexpr int64_t kTaskBlocks = 6;  // a task's column blocks: every C below divides into it
constexpr int64_t kKBlock = 128;  // pairs a pass over a task's weights (48 KiB) when rows take several tiles
constexpr int cols_for(int R) { return R <= 2 ? 8 : R <= 4 ? 6 : R <= 6 ? 4 : R <= 8 ? 3 : R <= 12 ? 2 : 1; }

template <int R, int C>
static void tile(const Tile& t, int64_t p0, int64_t p1, bool first) {
  const __mmask16 mask = t.width == kBlock ? (__mmask16)0xffff : (__mmask16)((1u << t.width) - 1);
  __m512 acc[R * C];
#pragma GCC unroll 32
  for (int i = 0; i < R * C; ++i)
    acc[i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(t.acc + (i / C) * t.ldacc + (i % C) * kBlock);
  const uint16_t* w = t.w + p0 * t.wstep;
  const uint16_t* x = t.x + 2 * R * p0;
  for (int64_t p = p0; p < p1; ++p, w += t.wstep, x += 2 * R) {
    __m512bh wv[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      wv[c] = (__m512bh)_mm512_maskz_loadu_epi32(mask, w + c * t.wblock);
      if constexpr (R >= 3) _mm_prefetch((const char*)(w + c * t.wblock + kPrefetch * t.wstep), _MM_HINT_T0);
    }
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + 2 * r, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r * C + c] = _mm512_dpbf16_ps(acc[r * C + c], wv[c], xv);
    }
  }
#pragma GCC unroll 32
  for (int i = 0; i < R * C; ++i) _mm512_storeu_ps(t.acc + (i / C) * t.ldacc + (i % C) * kBlock, acc[i]);
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kMaxRows = 4;  // 4 rows x 16 columns (2 vectors): 8 accumulators, 4 widened weights, 2 inputs
constexpr int kGemmRows = 4;
constexpr int64_t kTaskBlocks = 1;
constexpr int64_t kKBlock = 256;  // a block's 256 pairs (16 KiB) stay in L1 for the row tiles after the first
constexpr int cols_for(int) { return 1; }

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
      acc[r][h] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(t.acc + r * t.ldacc + h * 8);
  for (int64_t p = p0; p < p1; ++p) {
    __m256 we[2], wo[2];
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_maskload_epi32((const int*)(t.w + p * t.wstep) + h * 8, lanes[h]);
      we[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      wo[h] = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));
    }
    for (int r = 0; r < R; ++r) {
      const __m256 xe = _mm256_set1_ps(bf2f(t.x[2 * (p * R + r)]));
      const __m256 xo = _mm256_set1_ps(bf2f(t.x[2 * (p * R + r) + 1]));
      for (int h = 0; h < 2; ++h)
        acc[r][h] = _mm256_fmadd_ps(xo, wo[h], _mm256_fmadd_ps(xe, we[h], acc[r][h]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(t.acc + r * t.ldacc + h * 8, acc[r][h]);
}
#else
constexpr int kMaxRows = 1;
constexpr int kGemmRows = 1;
constexpr int64_t kTaskBlocks = 1;
constexpr int64_t kKBlock = 256;
constexpr int cols_for(int) { return 1; }

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

// tile<R, C> for R in [1, kMaxRows], C in [1, cols_for(R)], chosen at run time.
template <int R, int C = cols_for(R)>
static void tile_cols(int64_t cols, const Tile& t, int64_t p0, int64_t p1, bool first) {
  if constexpr (C > 1) {
    if (cols < C) return tile_cols<R, C - 1>(cols, t, p0, p1, first);
  }
  tile<R, C>(t, p0, p1, first);
}

template <int R = kMaxRows>
static void tile_rows(int64_t rows, int64_t cols, const Tile& t, int64_t p0, int64_t p1, bool first) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<R - 1>(rows, cols, t, p0, p1, first);
  }
  tile_cols<R>(cols, t, p0, p1, first);
}

// out[n] = sums[n] + bias[n] (bias may be null) rounded to bfloat16, n < n_cols: to nearest
// even, as f2bf (vcvtneps2bf16 where the build has it).
static void store_row(const float* sums, const uint16_t* bias, int64_t n_cols, uint16_t* out) {
  int64_t n = 0;
#ifdef __AVX512BF16__
  for (; n + 16 <= n_cols; n += 16) {
    __m512 v = _mm512_loadu_ps(sums + n);
    if (bias != nullptr) v = _mm512_add_ps(v, load16(bias + n));
    _mm256_storeu_si256((__m256i*)(out + n), (__m256i)_mm512_cvtneps_pbh(v));
  }
#endif
  for (; n < n_cols; ++n) out[n] = f2bf(sums[n] + (bias != nullptr ? bf2f(bias[n]) : 0.f));
}

// Where element (p, c, j) of a block of width wb sits in it (the layout above): the one place
// that both the packing and the row lookup read it from.
constexpr int64_t pair_at(int64_t p, int64_t c, int64_t j, int64_t wb) { return (p * wb + c) * 2 + j; }

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
            blk[pair_at(p, c, j, wb)] = k < K ? src[(n0 + c) * K + k] : 0;
          }
    }
  });
  return out;
}

// packed [N, Kp] from bf16_pair_pack, ids (any shape, int64 / int32, each in [0, N)) -> the
// weight's rows w[ids] [*ids.shape, K]: the lookup of an embedding whose tied LM head holds the
// table only in pairs (a row's pairs 64 bytes apart in its block).
torch::Tensor bf16_pair_rows(torch::Tensor packed, torch::Tensor ids, int64_t K) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous(),
              "bf16_pair_rows: a packed 2-D bfloat16 table");
  const int64_t N = packed.size(0), Kp = packed.size(1);
  TORCH_CHECK(K >= 1 && Kp == (K + 1) / 2 * 2, "bf16_pair_rows: the table is not K wide");
  TORCH_CHECK(ids.scalar_type() == torch::kLong || ids.scalar_type() == torch::kInt,
              "bf16_pair_rows: integer ids");
  auto sizes = ids.sizes().vec();
  sizes.push_back(K);
  const auto flat = ids.to(torch::kLong).contiguous().view(-1);
  const int64_t T = flat.numel();
  const int64_t* id = flat.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < N, "bf16_pair_rows: id ", id[t], " not in [0, ", N, ")");
  auto out = torch::empty(sizes, packed.options());
  const uint16_t* wp = bf_ptr(packed);
  uint16_t* op = bf_mut(out);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = id[t] / kBlock * kBlock, wb = std::min(kBlock, N - n0), c = id[t] - n0;
      const uint16_t* blk = wp + n0 * Kp;
      uint16_t* row = op + t * K;
      for (int64_t k = 0; k < K; ++k) row[k] = blk[pair_at(k / 2, c, k % 2, wb)];
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
  x = x.contiguous();
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  // Up to kMaxRows rows are one tile, which reads the weights once, whole K in registers; more
  // rows take tiles of kGemmRows over K in blocks, the later row tiles finding a block's weights
  // in the caches.
  const int64_t rows = M <= kMaxRows ? M : kGemmRows;
  // x in row tiles of pairs (the tile at row m: [P, R] 32-bit pairs from m Kp; an odd K's last
  // pair padded with a zero); one row is its own tile.
  const bool repack = M > 1 || K != Kp;
  std::unique_ptr<uint32_t[]> tiles(repack ? new uint32_t[M * P] : nullptr);  // every pair written below
  const uint16_t* xp = bf_ptr(x);
  if (repack) {
    // (on the calling thread below 64 Ki pairs: a decode step's few rows are microseconds of
    // copying, less than waking the other threads)
    at::parallel_for(0, P, std::max<int64_t>(512, (1 << 16) / M), [&](int64_t q0, int64_t q1) {
      for (int64_t m = 0; m < M; m += rows) {
        const int64_t R = std::min(rows, M - m);
        for (int64_t r = 0; r < R; ++r) {
          const uint16_t* row = xp + (m + r) * K;
          uint32_t* dst = tiles.get() + m * P + r;
          for (int64_t q = q0; q < q1; ++q) {
            const uint32_t lo = row[2 * q], hi = 2 * q + 1 < K ? row[2 * q + 1] : 0;
            dst[q * R] = lo | hi << 16;
          }
        }
      }
    });
    xp = reinterpret_cast<const uint16_t*>(tiles.get());
  }
  const uint16_t* wp = bf_ptr(packed);
  const uint16_t* bp = bias.has_value() ? bf_ptr(*bias) : nullptr;
  uint16_t* op = bf_mut(out);
  const int64_t full = N / kBlock, blocks = (N + kBlock - 1) / kBlock;
  // A task: up to kTaskBlocks whole blocks, or the narrow last block alone; fewer blocks a task
  // where there are few a thread.
  const int64_t cols = std::clamp<int64_t>(full / std::max(1, at::get_num_threads()), 1, kTaskBlocks);
  const int64_t tasks = (full + cols - 1) / cols + (blocks > full ? 1 : 0);
  const int64_t kblock = M <= kMaxRows ? P : kKBlock, ldacc = kTaskBlocks * kBlock;
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> acc(M * ldacc);  // [M, ldacc] the float32 sums of a task's columns
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task * cols;
      const bool narrow = b >= full;
      const int64_t nb = narrow ? 1 : std::min(cols, full - b), n0 = narrow ? full * kBlock : b * kBlock;
      const int64_t width = narrow ? N - n0 : kBlock;
      for (int64_t p0 = 0; p0 < P; p0 += kblock) {
        const int64_t p1 = std::min(P, p0 + kblock);
        for (int64_t m = 0; m < M; m += rows) {
          const int64_t R = std::min(rows, M - m), step = cols_for((int)R);
          for (int64_t c = 0; c < nb; c += step) {
            const Tile t{xp + m * Kp, wp + (n0 + c * kBlock) * Kp,         kBlock * Kp, 2 * width,
                         width,       acc.data() + m * ldacc + c * kBlock, ldacc};
            tile_rows(R, std::min(step, nb - c), t, p0, p1, p0 == 0);
          }
        }
      }
      for (int64_t m = 0; m < M; ++m)
        store_row(acc.data() + m * ldacc, bp ? bp + n0 : nullptr, nb * width, op + m * N + n0);
    }
  });
  return out;
}
