// What a decode step's layers share between decode_loop.cpp and gguf_decode_step.cpp: the
// attention of a layer from its qkv projection.
#pragma once

#include <torch/types.h>

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
  torch::Tensor operator()(const torch::Tensor& qkv, torch::Tensor& k_cache, torch::Tensor& v_cache) const {
    const int64_t M = qkv.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    auto q = qkv.narrow(1, 0, q_size).view({M, num_heads, head_dim});
    auto k = qkv.narrow(1, q_size, kv_size).view({M, num_kv_heads, head_dim});
    auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({M, num_kv_heads, head_dim});
    rotary_embedding_(q, k, cos, sin, positions);
    k_cache.index_copy_(0, slot_mapping, k);
    v_cache.index_copy_(0, slot_mapping, v);
    return paged_decode(q, k_cache, v_cache, block_table, seq_lens, block_size, scale, 0, c10::nullopt,
                        c10::nullopt)
        .reshape({M, q_size});
  }
};

// decode_layers' step where every linear is a GGUF weight with int8 activations and the step has
// <= 16 rows (gguf_decode_step.cpp): the same values, the step in one parallel region.
bool gguf_decode_step_applies(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                              size_t stride);
torch::Tensor gguf_decode_layers(torch::Tensor x, const std::vector<torch::Tensor>& weights,
                                 std::vector<torch::Tensor>& k_caches, std::vector<torch::Tensor>& v_caches,
                                 const StepAttention& attend, const torch::Tensor& final_norm, double eps);
