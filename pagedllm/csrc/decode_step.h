// What a decode step's layers share between decode_loop.cpp and gguf_decode_step.cpp: the
// attention of a layer from its qkv projection.
#pragma once

#include <torch/types.h>

#include <cstring>

#include "ops.h"

// The step's attention inputs: positions [M] int64, slot_mapping [M] int64, block_table
// [M, NB] int32, seq_lens [M] int32, the rope tables.
struct StepAttention {
  torch::Tensor positions, slot_mapping, block_table, seq_lens, cos, sin;
  int64_t num_heads, num_kv_heads, head_dim, block_size;
  double scale;
  // The same for rows [r0, r1) of the step (their own requests: each row's work is its own).
  StepAttention rows(int64_t r0, int64_t r1) const {
    const int64_t n = r1 - r0;
    return {positions.narrow(0, r0, n),
            slot_mapping.narrow(0, r0, n),
            block_table.narrow(0, r0, n),
            seq_lens.narrow(0, r0, n),
            cos,
            sin,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            scale};
  }
  // qkv [M, q + 2 kv] (rotated in place) -> rope, K/V written to the layer's caches [S, Hkv, D],
  // paged attention -> [M, q].
  torch::Tensor operator()(const torch::Tensor& qkv, const torch::Tensor& k_cache,
                           const torch::Tensor& v_cache) const {
    const auto out = torch::empty({qkv.size(0), num_heads * head_dim}, qkv.options());
    heads(qkv, k_cache, v_cache, 0, num_kv_heads, out);
    return out;
  }
  // The same for KV heads [h0, h1) and their query heads, into their columns of out [M, q] (the
  // other columns left alone): each head's work is its own, so the GGUF step's threads share a
  // layer's attention by heads (at one row, a thread's attention would leave the other waiting).
  void heads(const torch::Tensor& qkv, const torch::Tensor& k_cache, const torch::Tensor& v_cache, int64_t h0,
             int64_t h1, const torch::Tensor& out) const {
    const int64_t M = qkv.size(0), n = h1 - h0, G = num_heads / num_kv_heads, D = head_dim,
                  q_size = num_heads * D, kv_size = num_kv_heads * D;
    const auto q = qkv.narrow(1, h0 * G * D, n * G * D).view({M, n * G, D});
    const auto k = qkv.narrow(1, q_size + h0 * D, n * D).view({M, n, D});
    const auto v = qkv.narrow(1, q_size + kv_size + h0 * D, n * D).view({M, n, D});
    rotary_embedding_(q, k, cos, sin, positions);
    const auto kc = k_cache.narrow(1, h0, n), vc = v_cache.narrow(1, h0, n);
    write_slots(kc, k);
    write_slots(vc, v);
    paged_decode_into(q, kc, vc, block_table, seq_lens, block_size, scale, 0, c10::nullopt, c10::nullopt,
                      out.narrow(1, h0 * G * D, n * G * D).view({M, n * G, D}));
  }
  // src [M, n, D] into the cache's [S, n, D] rows at slot_mapping: cache.index_copy_(0,
  // slot_mapping, src), a copy a row where both are dense in (n, D) (index_copy_'s iterator costs
  // microseconds a call; the step makes two a layer's head claim). A bfloat16 cache of float32
  // rows: each value rounded to nearest even, as torch's .to(bfloat16) (the other writers').
  void write_slots(const torch::Tensor& cache, const torch::Tensor& src) const {
    const int64_t M = src.size(0), row = src.size(1) * src.size(2), S = cache.size(0);
    const bool same = cache.scalar_type() == src.scalar_type(),
               to_bf16 = cache.scalar_type() == torch::kBFloat16 && src.scalar_type() == torch::kFloat;
    if (!(same || to_bf16) || cache.stride(2) != 1 || cache.stride(1) != cache.size(2) ||
        src.stride(2) != 1 || src.stride(1) != src.size(2) || slot_mapping.scalar_type() != torch::kLong) {
      cache.index_copy_(0, slot_mapping, src.to(cache.scalar_type()));
      return;
    }
    const int64_t es = cache.element_size(), fs = src.element_size(), ss = slot_mapping.stride(0);
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    auto* to = static_cast<char*>(cache.data_ptr());
    const auto* from = static_cast<const char*>(src.data_ptr());
    for (int64_t m = 0; m < M; ++m) {
      const int64_t slot = slots[m * ss];
      TORCH_CHECK(slot >= 0 && slot < S, "a KV slot ", slot, " outside the cache's ", S);
      char* dst = to + slot * cache.stride(0) * es;
      const char* row_src = from + m * src.stride(0) * fs;
      if (same) {
        std::memcpy(dst, row_src, row * es);
      } else {
        auto* d = reinterpret_cast<c10::BFloat16*>(dst);
        const auto* f = reinterpret_cast<const float*>(row_src);
        for (int64_t i = 0; i < row; ++i) d[i] = c10::BFloat16(f[i]);
      }
    }
  }
};

// decode_layers' step where every linear is a GGUF weight with int8 activations and the step has
// <= 16 rows (gguf_decode_step.cpp): the same values, the step in one parallel region; nullopt
// where the step is not such a step. gguf_decode_step_applies: whether it is (the tests ask).
bool gguf_decode_step_applies(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                              size_t stride, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim);
c10::optional<torch::Tensor> gguf_decode_layers(torch::Tensor x, const std::vector<torch::Tensor>& weights,
                                                size_t stride, std::vector<torch::Tensor>& k_caches,
                                                std::vector<torch::Tensor>& v_caches,
                                                const StepAttention& attend, const torch::Tensor& final_norm,
                                                double eps);
