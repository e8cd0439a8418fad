"""A C++ paged-attention kernel for decode on the CPU, compiled once on first use.

The torch path gathers every decode request's whole context out of the paged cache into a
padded tensor each layer (a copy as large as the context) before attending. This kernel reads
K and V straight from the pages through the block table, once: for each (request, KV head)
the G query heads that share that KV head are scored together, then a softmax, then the
weighted sum of V. It is built with torch's cpp_extension (cached under
$TORCH_EXTENSIONS_DIR); if it cannot be built, `decode_attention` is None and the caller
keeps the torch path.
"""
from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

// q [B, H, D], caches [S, Hkv, D] (slot = block * block_size + offset), block_table [B, NB] int32,
// seq_lens [B] int32 -> out [B, H, D]. float32 only.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_table, torch::Tensor seq_lens,
                           int64_t block_size, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k_cache.scalar_type() == torch::kFloat);
  q = q.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  const int64_t G = H / Hkv, NB = block_table.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const int64_t ks = k_cache.stride(0), kh = k_cache.stride(1);
  const int64_t vs = v_cache.stride(0), vh = v_cache.stride(1);
  const float fscale = (float)scale;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / Hkv, h = idx % Hkv;
      const int64_t L = sl[b];
      scores.assign(G * L, 0.f);
      const float* qb = qp + (b * H + h * G) * D;
      // Scores: each key is read once for all G query heads of its group.
      for (int64_t t = 0; t < L; ++t) {
        const int64_t slot = (int64_t)bt[b * NB + t / block_size] * block_size + t % block_size;
        const float* k = kp + slot * ks + h * kh;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qb + g * D;
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s += qg[d] * k[d];
          scores[g * L + t] = s * fscale;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * L;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < L; ++t) m = sg[t] > m ? sg[t] : m;
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) { sg[t] = std::exp(sg[t] - m); sum += sg[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const int64_t slot = (int64_t)bt[b * NB + t / block_size] * block_size + t % block_size;
        const float* v = vp + slot * vs + h * vh;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t];
          float* a = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        std::copy(acc.begin() + g * D, acc.begin() + (g + 1) * D, op + (b * H + h * G + g) * D);
    }
  });
  return out;
}
"""

def _build():
    if os.environ.get("PAGEDLLM_NO_CPU_KERNELS"):
        return None
    try:
        from torch.utils.cpp_extension import load_inline
        mod = load_inline(name="pagedllm_cpu_kernels_v1", cpp_sources=[_SOURCE], functions=["paged_decode"],
                          extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"], verbose=False)
        return mod.paged_decode
    except Exception as e:  # no compiler, no ninja: the torch path still works
        logger.warning("C++ paged-attention kernel not built (%s); using the torch path", e)
        return None


_kernel = None
_tried = False


def decode_kernel():
    """The compiled kernel, or None (built at most once per process)."""
    global _kernel, _tried
    if not _tried:
        _tried = True
        _kernel = _build()
    return _kernel
