// The decoder layers of a decode step (<= ROWS rows) whose linears are all GGUF weights with
// int8 activations (codes in quads), in ONE parallel region for the whole step, instead of one
// fork and join per linear (decode_loop.cpp's path: 4 a layer, 64 a step of a 16-layer model).
// llama.cpp's CPU backend does the same: its threads live through the graph and meet at a
// barrier between ops.
//
// The step is a sequence of phases, one per linear (qkv, o, gate_up, down of each layer). A
// phase's weight is cut in claims (runs of groups, gguf_linear.cpp's decode rows) that the
// threads take in turn; the thread that completes a phase's LAST claim publishes the work
// between that linear and the next (rope, the KV write and attention; the residual add and the
// norm; the activation; each followed by the next linear's int8 quantization), itself in claims
// of ROWS_A_CLAIM rows (each row's work is its own: at 16 rows one thread's attention would
// leave the other waiting), the attention's claims also cut by KV heads (at one row, a layer's
// attention over a context of a few hundred tokens is ~100 us of one thread's time), and the
// thread completing its last claim publishes the next phase.
// A thread waits only for a stage's work to be done, never for the other threads to arrive: one
// the OS descheduled (a busy machine) costs nothing unless it holds a claim, where a barrier
// (libgomp's join) waits for it every time. The values are those of decode_loop.cpp's path bit
// for bit: the same kernels on the same activations, each output group computed once, whole,
// by one thread, and every op between the linears row by row.
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <atomic>
#include <exception>
#include <memory>
#include <thread>
#include <vector>

#include "decode_step.h"
#include "gguf_blocks.h"
#include "gguf_groups.h"
#include "ops.h"

namespace {

using namespace gguf;

constexpr int64_t LINEARS = 4;      // a layer's: qkv, o, gate_up, down
constexpr int64_t PER = 4;          // tensors a quantized linear: qweight, bias, group table, (empty) mins
constexpr int64_t ROWS = 2 * TILE;  // the most rows a step: a group's codes serve both tiles from L1
// The work between linears in claims of a tile's rows: the rows of one tile share the cache
// lines of their int8 activations' steps and sums (Acts8's tile-major fields), so two threads
// quantizing halves of a tile wrote the same lines (claims of 4 rows: 16-row steps 1.01-1.08x
// slower).
constexpr int64_t ROWS_A_CLAIM = TILE;
constexpr int64_t HEAD_CLAIMS = 1;  // claims of a row's attention a thread (each of some KV heads)
constexpr int64_t TAIL_SPLIT = 4;   // a linear's last claims (a thread's one each) cut in this many

// One linear of the step: its groups, input features, the int8 activations' span, its claims:
// `coarse` of per_claim groups, then claims of `fine` groups for the last `threads` claims' worth
// (a thread that ends its share waits for the others' last claims: ~9 us at one row for a
// claim of 256 KiB, 64 times a step, unless the last claims are short).
struct Lin {
  Groups gs;
  int64_t K, span, per_claim, coarse, fine, claims;
  const float* bias;
  // claim k's groups [g0, g1)
  std::pair<int64_t, int64_t> range(int64_t k) const {
    const int64_t g0 = k < coarse ? k * per_claim : coarse * per_claim + (k - coarse) * fine;
    return {g0, std::min(gs.G, g0 + (k < coarse ? per_claim : fine))};
  }
};

// The linear's third tensor is a GGUF group table (other quantized linears have their scales
// there).
bool is_group_table(const torch::Tensor& meta) {
  return meta.scalar_type() == torch::kLong && meta.dim() == 2 && meta.size(1) == 4 && meta.is_contiguous();
}

Lin make_lin(const torch::Tensor* p, int64_t K, int64_t threads) {
  const Groups gs = check_groups(p[0], p[2], K);
  const torch::Tensor& b = p[1];
  TORCH_CHECK(!b.numel() || (b.is_contiguous() && b.scalar_type() == torch::kFloat && b.numel() == gs.N),
              "a GGUF linear's bias: float32 [", gs.N, "]");
  const int64_t per_claim = groups_per_claim(gs, K), fine = std::max<int64_t>(1, per_claim / TAIL_SPLIT),
                coarse = std::max<int64_t>(0, gs.G / per_claim - threads);
  return Lin{gs,
             K,
             gs.layouts.kquads ? 256 : QB,
             per_claim,
             coarse,
             fine,
             coarse + (gs.G - coarse * per_claim + fine - 1) / fine,
             b.numel() ? b.data_ptr<float>() : nullptr};
}

// A phase's claims: taken (next) and completed (done); a line each (the threads write both).
struct alignas(64) Counter {
  std::atomic<int64_t> next{0}, done{0};
};

// Spins until phase `phase` is published, false once a thread failed (a pause each try; after
// ~4k tries the core is given to the OS between tries: the thread awaited is not running then,
// and the spin would only delay it).
bool wait_for(const std::atomic<int64_t>& published, const std::atomic<bool>& failed, int64_t phase) {
  for (int spins = 0; published.load(std::memory_order_acquire) < phase; ++spins) {
    if (failed.load(std::memory_order_relaxed)) return false;
    if (spins < 4096) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    } else {
      std::this_thread::yield();
    }
  }
  return !failed.load(std::memory_order_relaxed);
}

// The step's rows, dtype and linears (GGUF group tables) fit the step; whether every group is in
// quads is read from the tables as they are checked.
bool step_fits(const torch::Tensor& x, const std::vector<torch::Tensor>& weights, size_t stride) {
  if (x.size(0) > ROWS || x.scalar_type() != torch::kFloat || stride != 2 + LINEARS * PER) return false;
  for (size_t l = 0; l < weights.size(); l += stride)
    for (int64_t at : {int64_t{1}, 1 + PER, 2 + 2 * PER, 2 + 3 * PER})
      if (!is_group_table(weights[l + at + 2])) return false;
  return true;
}

// The step's linears in step order (qkv, o, gate_up, down of each layer), or nullopt where the
// step does not apply: too many rows, not float32, a linear that is not a GGUF group table, or
// groups that take int16 pairs (the step's activations are int8 quads).
c10::optional<std::vector<Lin>> step_lins(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                                          size_t stride, int64_t q_size, int64_t kv_size, int64_t threads) {
  if (!step_fits(x, weights, stride)) return c10::nullopt;
  const int64_t H = x.size(1), layers = (int64_t)(weights.size() / stride);
  std::vector<Lin> lins;
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor* w = &weights[stride * l];
    lins.push_back(make_lin(w + 1, H, threads));
    TORCH_CHECK(lins.back().gs.N == q_size + 2 * kv_size, "layer ", l, ": qkv has ", lins.back().gs.N,
                " rows");
    lins.push_back(make_lin(w + 1 + PER, q_size, threads));
    lins.push_back(make_lin(w + 2 + 2 * PER, H, threads));
    lins.push_back(make_lin(w + 2 + 3 * PER, lins.back().gs.N / 2, threads));
    for (int64_t i = LINEARS * l; i < LINEARS * (l + 1); ++i)
      if (lins[i].gs.layouts.pairs) return c10::nullopt;
    TORCH_CHECK(lins[LINEARS * l + 1].gs.N == H && lins[LINEARS * l + 3].gs.N == H, "layer ", l,
                ": o and down must give ", H, " features");
    for (int64_t i = 0; i < LINEARS; ++i)  // the step's outputs are shared by the layers
      TORCH_CHECK(lins[LINEARS * l + i].gs.N == lins[i].gs.N, "layer ", l, ": linear ", i, " has ",
                  lins[LINEARS * l + i].gs.N, " rows, layer 0's ", lins[i].gs.N);
  }
  return lins;
}

}  // namespace

bool gguf_decode_step_applies(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                              size_t stride, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  return step_lins(x, weights, stride, num_heads * head_dim, num_kv_heads * head_dim, at::get_num_threads())
      .has_value();
}

c10::optional<torch::Tensor> gguf_decode_layers(torch::Tensor x, const std::vector<torch::Tensor>& weights,
                                                size_t stride, std::vector<torch::Tensor>& k_caches,
                                                std::vector<torch::Tensor>& v_caches,
                                                const StepAttention& attend, const torch::Tensor& final_norm,
                                                double eps) {
  const int64_t q_size = attend.num_heads * attend.head_dim, kv_size = attend.num_kv_heads * attend.head_dim,
                threads = at::get_num_threads();
  auto step = step_lins(x, weights, stride, q_size, kv_size, threads);
  if (!step) return c10::nullopt;
  const std::vector<Lin>& lins = *step;
  const int64_t M = x.size(0), H = x.size(1), layers = (int64_t)k_caches.size();
  int64_t max_k = H;  // the widest activations a linear takes
  for (const Lin& lin : lins) max_k = std::max(max_k, lin.K);
  // The layers' norm weights in step order (input, post-attention), float32 [H] each.
  std::vector<const float*> norms;
  for (int64_t l = 0; l < layers; ++l)
    for (const torch::Tensor* n : {&weights[stride * l], &weights[stride * l + 1 + 2 * PER]}) {
      TORCH_CHECK(n->scalar_type() == torch::kFloat && n->is_contiguous() && n->numel() == H, "layer ", l,
                  ": a norm's weight: float32 [", H, "]");
      norms.push_back(n->data_ptr<float>());
    }
  const auto f = x.options();
  x = x.clone(at::MemoryFormat::Contiguous);  // [M, H] the residual stream, added to in place
  std::vector<torch::Tensor> outs;
  for (int64_t i = 0; i < LINEARS; ++i) outs.push_back(torch::empty({M, lins[i].gs.N}, f));
  // torch's allocator: 64-byte aligned, not zero-filled (as gguf_linear.cpp's per-linear buffer)
  const torch::Tensor buf = torch::empty({acts8_bytes(M, max_k)}, f.dtype(torch::kByte));
  const torch::Tensor scratch = torch::empty({M, max_k}, f);
  // the next linear's activations (in buf): their layout set before the rows are quantized
  Acts8 acts = acts8_at(buf.data_ptr<uint8_t>(), M, lins[0].K, lins[0].span);
  // After a layer's qkv, claim k: rows [r0, r1) of row claim k / head_claims, KV heads h0-h1 of
  // head claim k % head_claims: rope, K/V write and attention into `attn`; the claim completing
  // the row claim's heads quantizes its rows for the o linear.
  const torch::Tensor attn = torch::empty({M, q_size}, f);
  const int64_t Hkv = attend.num_kv_heads,
                heads_a_claim = (Hkv + HEAD_CLAIMS * threads - 1) / (HEAD_CLAIMS * threads),
                head_claims = (Hkv + heads_a_claim - 1) / heads_a_claim,
                row_claims = (M + ROWS_A_CLAIM - 1) / ROWS_A_CLAIM;
  std::unique_ptr<std::atomic<int64_t>[]> heads_done(new std::atomic<int64_t>[layers * row_claims]);
  for (int64_t i = 0; i < layers * row_claims; ++i) heads_done[i].store(0, std::memory_order_relaxed);
  auto attention = [&](int64_t l, int64_t k) {
    const int64_t r = k / head_claims, h0 = k % head_claims * heads_a_claim, r0 = r * ROWS_A_CLAIM,
                  r1 = std::min(M, r0 + ROWS_A_CLAIM);
    attend.rows(r0, r1).heads(outs[0].narrow(0, r0, r1 - r0), k_caches[l], v_caches[l], h0,
                              std::min(Hkv, h0 + heads_a_claim), attn.narrow(0, r0, r1 - r0));
    if (heads_done[l * row_claims + r].fetch_add(1, std::memory_order_acq_rel) + 1 == head_claims)
      quantize_acts8_rows(attn.data_ptr<float>() + r0 * q_size, acts, r0, r1);
  };
  // The work after phase p's linear for rows [r0, r1), ending with those rows of phase p + 1's
  // activations: raw loops over the rows (at one row a hand-off is the other thread's wait), the
  // norm and the activation by the eager ops' own row functions.
  float* const xp = x.data_ptr<float>();
  float* const rows_f = scratch.data_ptr<float>();  // a hand-off's rows before quantization
  auto after = [&](int64_t p, int64_t r0, int64_t r1) {
    const int64_t l = p / LINEARS, N = lins[p].gs.N;
    const float* out = outs[p % LINEARS].data_ptr<float>();
    if (p % LINEARS == 2) {  // gate_up -> the activation
      const int64_t I = N / 2;
      for (int64_t r = r0; r < r1; ++r) silu_and_mul_row(out + r * N, out + r * N + I, rows_f + r * I, I);
      return quantize_acts8_rows(rows_f + r0 * I, acts, r0, r1);
    }
    // o -> the MLP's norm, down -> the next layer's (case 0, qkv -> attention: `attention`)
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t i = 0; i < H; ++i) xp[r * H + i] += out[r * H + i];
    const float* norm = p % LINEARS == 1 ? norms[2 * l + 1] : l + 1 < layers ? norms[2 * l + 2] : nullptr;
    if (!norm) return;
    for (int64_t r = r0; r < r1; ++r) rms_norm_row(xp + r * H, norm, rows_f + r * H, H, (float)eps);
    quantize_acts8_rows(rows_f + r0 * H, acts, r0, r1);
  };
  for (int64_t r = 0; r < M; ++r) rms_norm_row(xp + r * H, norms[0], rows_f + r * H, H, (float)eps);
  quantize_acts8_rows(rows_f, acts, 0, M);
  const int64_t phases = (int64_t)lins.size();
  // Stage 2p: phase p's linear, claims of groups; 2p + 1: the work after it, claims of rows.
  std::unique_ptr<Counter[]> counters(new Counter[2 * phases]);
  std::atomic<int64_t> published{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  // A failure (a check in a kernel or an op) stops every thread at its next wait; the first is
  // rethrown after the region.
  auto fail = [&] {
    if (!failed.exchange(true)) error = std::current_exception();
  };
  // The serial work runs on whichever thread: each takes the caller's inference mode (in-place
  // writes to the KV caches, inference tensors) and dispatch state.
  const at::ThreadLocalState state;
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    const at::ThreadLocalStateGuard guard(state);
    try {
      for (int64_t s = 0; s < 2 * phases; ++s) {
        if (!wait_for(published, failed, s)) return;
        const int64_t p = s / 2;
        const Lin& lin = lins[p];
        const int64_t claims = s % 2 == 0 ? lin.claims : p % LINEARS ? row_claims : row_claims * head_claims;
        float* out = outs[p % LINEARS].data_ptr<float>();
        Counter& c = counters[s];
        for (int64_t k; (k = c.next.fetch_add(1, std::memory_order_relaxed)) < claims;) {
          if (s % 2 && p % LINEARS == 0)
            attention(p / LINEARS, k);
          else if (s % 2)
            after(p, k * ROWS_A_CLAIM, std::min(M, (k + 1) * ROWS_A_CLAIM));
          else
            for (auto [g, g1] = lin.range(k); g < g1; ++g) {
              const int64_t* e = lin.gs.meta + 4 * g;
              run_group8(lin.gs.base + e[0], e[1], acts, 0, M, e[2], (int)e[3], lin.bias, out, lin.gs.N);
            }
          if (c.done.fetch_add(1, std::memory_order_acq_rel) + 1 == claims) {
            if (s % 2 == 0 && p + 1 < phases)  // linear p is done with buf: the next one's layout
              acts = acts8_at(buf.data_ptr<uint8_t>(), M, lins[p + 1].K, lins[p + 1].span);
            published.store(s + 1, std::memory_order_release);
          }
        }
      }
    } catch (...) {
      fail();
    }
  });
  if (error) std::rethrow_exception(error);
  return rms_norm(x, final_norm, eps);
}
