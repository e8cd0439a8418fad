// The decoder layers of a decode step in one call (see models/cpu_decode_loop.py): the kernels
// of attention.cpp and fused_ops.cpp, and oneDNN's packed linear or bf16_linear.cpp's pair
// kernel, in the eager path's order, on the same values.
#include <ATen/core/dispatch/Dispatcher.h>

#include <vector>

#include "decode_step.h"
#include "ops.h"

static c10::optional<torch::Tensor> opt(const torch::Tensor& t) {
  return t.numel() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

// x [M, K] @ the weight oneDNN reordered at load time ([N, K] in its blocked layout) + b -> [M, N]:
// the op the eager path's packed linear calls above its small rows
// (models/layers/cpu_packed_linear.py), looked up once in torch's dispatcher.
static torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed,
                                   const c10::optional<torch::Tensor>& b) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<torch::Tensor(const torch::Tensor&, const torch::Tensor&,
                               const c10::optional<torch::Tensor>&, c10::string_view,
                               c10::List<c10::optional<c10::Scalar>>, c10::optional<c10::string_view>)>();
  return op.call(x, packed, b, "none", c10::List<c10::optional<c10::Scalar>>(), c10::string_view(""));
}

// One linear of the loop: a float weight as its method holds it for few rows and for more
// (`small` up to small_rows rows: the plain weight for linear_small, or the pair layout for
// bf16_pair_linear where `small_pairs`; `large` above: oneDNN's packed weight, or the pair layout
// where `large_pairs`, bfloat16 without oneDNN's bf16 kernels), as the eager path picks; or a
// quantized one with its scales and mins (quant_linear, float32 activations), or GGUF blocks with
// their int64 group table in the scales' place (gguf_linear).
struct Linear {
  const torch::Tensor *small, *b, *large, *s, *m;  // large: a float linear's; s, m: a quantized one's
  int64_t small_rows;
  bool small_pairs, large_pairs;
  torch::Tensor operator()(const torch::Tensor& x) const {
    if (large != nullptr) {
      if (x.size(0) <= small_rows)
        return small_pairs ? bf16_pair_linear(x, *small, opt(*b)) : linear_small(x, *small, opt(*b));
      return large_pairs ? bf16_pair_linear(x, *large, opt(*b)) : packed_linear(x, *large, opt(*b));
    }
    if (s->scalar_type() == torch::kLong) return gguf_linear(x, *small, *s, opt(*b));
    return quant_linear(x, *small, *s, *m, opt(*b));
  }
};

// x [M, hidden] (the embedded tokens), positions [M] int64; per layer 14 tensors: input norm,
// qkv small weight, bias, large weight, o's three, post-attention norm, gate_up's three,
// down's three (an empty tensor = no bias); or 18 with quantized linears, each linear then
// weight, bias, scales, mins; caches [S, Hkv, D] per layer; small_rows, small_pairs, large_pairs:
// the float linears' kernels (Linear);
// slot_mapping [M] int64, block_table [M, NB] int32, seq_lens [M] int32 -> hidden [M, hidden].
torch::Tensor decode_layers(torch::Tensor x, torch::Tensor positions, std::vector<torch::Tensor> weights,
                            std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
                            torch::Tensor slot_mapping, torch::Tensor block_table, torch::Tensor seq_lens,
                            torch::Tensor cos, torch::Tensor sin, torch::Tensor final_norm, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t block_size, double eps,
                            double scale, int64_t small_rows, bool small_pairs, bool large_pairs) {
  TORCH_CHECK(k_caches.size() == v_caches.size() && !k_caches.empty());
  const size_t stride = weights.size() / k_caches.size();
  TORCH_CHECK((stride == 14 || stride == 18) && weights.size() == stride * k_caches.size());
  const int per = stride == 14 ? 3 : 4;  // tensors per linear
  const StepAttention attend{positions, slot_mapping, block_table, seq_lens,   cos,  sin,
                             num_heads, num_kv_heads, head_dim,    block_size, scale};
  // the step in one parallel region, where it applies
  if (auto out = gguf_decode_layers(x, weights, stride, k_caches, v_caches, attend, final_norm, eps))
    return *out;
  for (size_t l = 0; l < k_caches.size(); ++l) {
    const torch::Tensor* w = &weights[stride * l];
    auto lin = [&](int at) {
      const torch::Tensor* p = w + at;
      return per == 3 ? Linear{p, p + 1, p + 2, nullptr, nullptr, small_rows, small_pairs, large_pairs}
                      : Linear{p, p + 1, nullptr, p + 2, p + 3, small_rows, false, false};
    };
    const Linear qkv_proj = lin(1), o_proj = lin(1 + per), gate_up_proj = lin(2 + 2 * per),
                 down_proj = lin(2 + 3 * per);
    const torch::Tensor &input_norm = w[0], &post_norm = w[1 + 2 * per];
    auto qkv = qkv_proj(rms_norm(x, input_norm, eps));  // [M, q + 2 kv]
    x = x + o_proj(attend(qkv, k_caches[l], v_caches[l]));
    auto gate_up = gate_up_proj(rms_norm(x, post_norm, eps));
    x = x + down_proj(silu_and_mul(gate_up));
  }
  return rms_norm(x, final_norm, eps);
}
