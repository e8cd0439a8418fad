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
#ifdef __AVX512F__
#include <immintrin.h>
#endif

// x [M, K] (M <= 4 rows, contiguous), w [N, K] contiguous -> x w^T (+ bias) [M, N]. A decode
// step at batch 1 is bound by reading the weights: each thread streams its own run of rows
// once, front to back, and dots each with the M inputs held in L1.
template <int M>
static void small_rows(const float* x, const float* w, const float* bias, float* out,
                       int64_t K, int64_t N) {
  at::parallel_for(0, N, 32, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* wr = w + n * K;
      float tail[M] = {};
      int64_t k = 0;
#ifdef __AVX512F__
      __m512 acc[M];
      for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
      for (; k + 16 <= K; k += 16) {
        const __m512 wv = _mm512_loadu_ps(wr + k);
        for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k), wv, acc[m]);
      }
      for (int m = 0; m < M; ++m) tail[m] = _mm512_reduce_add_ps(acc[m]);
#endif
      for (; k < K; ++k)
        for (int m = 0; m < M; ++m) tail[m] += x[m * K + k] * wr[k];
      for (int m = 0; m < M; ++m) out[m * N + n] = tail[m] + (bias ? bias[n] : 0.f);
    }
  });
}

torch::Tensor linear_small(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= 4 && x.scalar_type() == torch::kFloat);
  TORCH_CHECK(w.is_contiguous() && w.size(1) == x.size(1));
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto out = torch::empty({M, N}, x.options());
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  switch (M) {
    case 1: small_rows<1>(xp, wp, b, op, K, N); break;
    case 2: small_rows<2>(xp, wp, b, op, K, N); break;
    case 3: small_rows<3>(xp, wp, b, op, K, N); break;
    default: small_rows<4>(xp, wp, b, op, K, N); break;
  }
  return out;
}

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
    """The compiled module (rms_norm, silu_and_mul, rotary_embedding_, linear_small), or None."""
    global _ops, _tried
    if not _tried:
        _tried = True
        _ops = build_cpu_extension("pagedllm_cpu_ops_v2", _SOURCE,
                                   ["rms_norm", "silu_and_mul", "rotary_embedding_", "linear_small"])
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
