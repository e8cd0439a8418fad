// The extension's functions: defined in attention.cpp, prefill_attention.cpp, fused_ops.cpp and
// decode_loop.cpp (which calls the others), bound to Python in bindings.cpp. Shapes and dtypes at each
// definition.
#pragma once

#include <torch/types.h>

#include <tuple>
#include <vector>

// attention.cpp
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_table, torch::Tensor seq_lens, int64_t block_size,
                           double scale, int64_t window, c10::optional<torch::Tensor> k_scale,
                           c10::optional<torch::Tensor> v_scale);
void paged_decode_into(torch::Tensor q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                       const torch::Tensor& block_table, const torch::Tensor& seq_lens, int64_t block_size,
                       double scale, int64_t window, const c10::optional<torch::Tensor>& k_scale,
                       const c10::optional<torch::Tensor>& v_scale, const torch::Tensor& out);

// prefill_attention.cpp
void paged_prefill(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor out,
                   torch::Tensor q_start, torch::Tensor q_len, torch::Tensor seq_lens,
                   torch::Tensor block_table, int64_t block_size, double scale, int64_t window);

// argmax.cpp
torch::Tensor argmax_rows(torch::Tensor logits);

// fused_ops.cpp
torch::Tensor linear_small(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor silu_and_mul(torch::Tensor x);
// One float32 row of each (x, gate, up and out: N or I contiguous floats).
void rms_norm_row(const float* x, const float* w, float* out, int64_t N, float eps);
void silu_and_mul_row(const float* gate, const float* up, float* out, int64_t I);
void rotary_embedding_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin,
                       torch::Tensor positions);

// bf16_linear.cpp
torch::Tensor bf16_pair_pack(torch::Tensor w);
torch::Tensor bf16_pair_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias);
torch::Tensor bf16_pair_rows(torch::Tensor packed, torch::Tensor ids, int64_t K);

// quant_ops.cpp
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor mins,
                           c10::optional<torch::Tensor> bias);
torch::Tensor quant_dequantize(torch::Tensor qweight, torch::Tensor scales, torch::Tensor mins);
std::tuple<torch::Tensor, torch::Tensor> quant_activations(torch::Tensor x);

// gguf_linear.cpp
torch::Tensor gguf_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor meta,
                          c10::optional<torch::Tensor> bias);
torch::Tensor gguf_dequantize_rows(torch::Tensor packed, torch::Tensor meta, int64_t K, torch::Tensor rows);

// decode_loop.cpp
torch::Tensor decode_layers(torch::Tensor x, torch::Tensor positions, std::vector<torch::Tensor> weights,
                            std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
                            torch::Tensor slot_mapping, torch::Tensor block_table, torch::Tensor seq_lens,
                            torch::Tensor cos, torch::Tensor sin, torch::Tensor final_norm, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t block_size, double eps,
                            double scale, int64_t small_rows, bool small_pairs, bool large_pairs);
