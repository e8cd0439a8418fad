"""Fused float32 CPU ops for the layers' element-wise work: RMSNorm, SiLU-and-multiply, RoPE.

In eager torch each of these is 5-10 passes over the activations (pow, mean, add, rsqrt,
mul, mul; silu, mul; index, mul, neg, cat, ...), each a kernel launch from Python; here each is
one pass over the rows, in parallel. The arithmetic is transformers' (RMSNorm in float32,
rotate-half RoPE); only the order of a row's sum differs. Other dtypes, or a machine where
the extension cannot be built, keep the torch code in models/llama.py.
"""
from __future__ import annotations

import torch

from pagedllm.attention.cpu_kernels import build_cpu_extension

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

// x [T, N] (rows may be strided) -> x / sqrt(mean(x^2) + eps) * w, contiguous [T, N].
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == torch::kFloat);
  const int64_t T = x.size(0), N = x.size(1), xs = x.stride(0);
  auto out = torch::empty({T, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.contiguous().data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* r = xp + t * xs;
      float ss = 0.f;
      for (int64_t i = 0; i < N; ++i) ss += r[i] * r[i];
      const float inv = 1.f / std::sqrt(ss / N + (float)eps);
      float* o = op + t * N;
      for (int64_t i = 0; i < N; ++i) o[i] = wp[i] * (r[i] * inv);
    }
  });
  return out;
}

// x [T, 2I] (gate | up) -> silu(gate) * up, [T, I].
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == torch::kFloat);
  const int64_t T = x.size(0), I = x.size(1) / 2, xs = x.stride(0);
  auto out = torch::empty({T, I}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = xp + t * xs;
      const float* u = g + I;
      float* o = op + t * I;
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

// In place, rotate-half convention: x [T, nh, D] (row stride free, heads contiguous), the
// first `rot` dims of each head rotated by cos/sin [P, rot] at positions [T] (int64).
static void rope_one(torch::Tensor x, const float* cp, const float* sp, const int64_t* pos, int64_t rot) {
  const int64_t T = x.size(0), nh = x.size(1), ts = x.stride(0), hs = x.stride(1), half = rot / 2;
  float* xp = x.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + pos[t] * rot;
      const float* s = sp + pos[t] * rot;
      for (int64_t h = 0; h < nh; ++h) {
        float* v = xp + t * ts + h * hs;
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          v[i] = a * c[i] - b * s[i];
          v[i + half] = b * c[i + half] + a * s[i + half];
        }
      }
    }
  });
}

void rotary_embedding_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin,
                       torch::Tensor positions) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k.scalar_type() == torch::kFloat);
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && cos.is_contiguous() && sin.is_contiguous());
  const int64_t rot = cos.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  rope_one(q, cos.data_ptr<float>(), sin.data_ptr<float>(), pos, rot);
  rope_one(k, cos.data_ptr<float>(), sin.data_ptr<float>(), pos, rot);
}
"""

_ops = None
_tried = False


def cpu_ops():
    """The compiled module (rms_norm, silu_and_mul, rotary_embedding_), or None."""
    global _ops, _tried
    if not _tried:
        _tried = True
        _ops = build_cpu_extension("pagedllm_cpu_ops_v1", _SOURCE,
                                   ["rms_norm", "silu_and_mul", "rotary_embedding_"])
    return _ops


def enable_fused_cpu_ops(model: torch.nn.Module) -> bool:
    """Give every RMSNorm, MLP and rotary embedding of a loaded float32 CPU model the fused
    ops (their `ops` attribute; None keeps the torch code). Decided once, at load time."""
    param = next(model.parameters())
    if param.dtype != torch.float32 or param.device.type != "cpu":
        return False
    ops = cpu_ops()
    if ops is None:
        return False
    for m in model.modules():
        if hasattr(m, "ops"):
            m.ops = ops
    return True
