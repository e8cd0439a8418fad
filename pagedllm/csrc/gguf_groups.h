// A GGUF weight as gguf_linear.cpp's kernels take it (its header describes the layout): the
// packed bytes and the group table, checked once, and how a decode step's threads share it.
#pragma once

#include <torch/types.h>

#include <cstdint>

namespace gguf {

// The activations a weight's groups take (a fused weight may hold both layouts): int16 pairs,
// int8 quads, and quads a super-block of 256 at a step (a K-quant group's kernel needs it).
struct Layouts {
  bool pairs, quads, kquads;
};

struct Groups {
  const uint8_t* base;
  const int64_t* meta;  // [G, 4]: byte offset, type, first row, rows
  int64_t G, N;
  Layouts layouts;
};

// packed uint8, meta [G, 4] int64 for K input features: each group inside the bytes; one pass
// over the table (a decode step checks its 64 linears' ~24k groups every step).
Groups check_groups(const torch::Tensor& packed, const torch::Tensor& meta, int64_t K);

// Decode rows (<= TILE): the groups of one claim, the runs a thread takes in turn (see
// gguf_linear.cpp's run_decode_rows).
int64_t groups_per_claim(const Groups& gs, int64_t K);

}  // namespace gguf
