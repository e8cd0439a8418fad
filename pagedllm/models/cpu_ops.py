"""Fused CPU ops for the layers' element-wise work: RMSNorm, SiLU-and-multiply, RoPE; and the
row-streaming matrix-vector product for 1-3 rows (`linear_small`). float32 and bfloat16.

In eager torch each of these is 5-10 passes over the activations (pow, mean, add, rsqrt,
mul, mul; silu, mul; index, mul, neg, cat, ...), each a kernel launch from Python; here each is
one pass over the rows, in parallel. The arithmetic is transformers' (RMSNorm in float32,
rotate-half RoPE); only the order of a row's sum differs. In bfloat16 each op computes in
float32 and rounds to bfloat16 where torch's bfloat16 ops round (so the result is torch's up to
the order of a sum); `linear_small` accumulates in float32 and rounds once. Other dtypes, or a
machine where the extension cannot be built, keep the layers' torch code (models/layers/).
"""
from __future__ import annotations

import torch

from pagedllm.attention.cpu_kernels import build_cpu_extension

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

// bfloat16 is the upper half of a float32: widening is a shift; narrowing rounds to nearest
// even, NaN to the canonical quiet NaN (c10::BFloat16's rule, so results equal torch's casts).
static inline float bf2f(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t f2bf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline float round_bf(float f) { return bf2f(f2bf(f)); }
static inline const uint16_t* bf_ptr(const torch::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}
static inline uint16_t* bf_mut(torch::Tensor& t) {
  return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
}

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

// The same for bfloat16 x [M, K] and w [N, K]: products summed in float32, each output
// rounded once (+ bias) to bfloat16. Half the bytes of float32 a weight, so twice the rows a
// second at the same memory rate. With AVX512-BF16, `vdpbf16ps` multiplies 32 bfloat16 pairs
// exactly and adds them into 16 float32 lanes; two accumulators per input halve the chain
// of dependent adds. (Four weight rows at a time, interleaved, streamed at 16 GB/s against
// 25 for one row front to back: not kept.)
#ifdef __AVX512BF16__
template <int M>
static inline void bf16_dot_dp(const uint16_t* x, const uint16_t* wr, int64_t K, float out[M]) {
  __m512 acc0[M], acc1[M];
  for (int m = 0; m < M; ++m) acc0[m] = acc1[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + k);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wr + k + 32);
    for (int m = 0; m < M; ++m) {
      acc0[m] = _mm512_dpbf16_ps(acc0[m], w0, (__m512bh)_mm512_loadu_si512(x + m * K + k));
      acc1[m] = _mm512_dpbf16_ps(acc1[m], w1, (__m512bh)_mm512_loadu_si512(x + m * K + k + 32));
    }
  }
  // The tail, 32 at a time, the last masked: the zeros past the row's end add nothing.
  for (; k < K; k += 32) {
    const __mmask32 mask = K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (K - k)) - 1);
    const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr + k);
    for (int m = 0; m < M; ++m)
      acc0[m] = _mm512_dpbf16_ps(acc0[m], w0, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k));
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[m], acc1[m]));
}
#endif

// Without AVX512-BF16: one weight row widened to float32 against the M inputs already widened
// (xf [M, K]); AVX-512F, else scalar.
template <int M>
static inline void bf16_dot_f32(const float* xf, const uint16_t* wr, int64_t K, float out[M]) {
  for (int m = 0; m < M; ++m) out[m] = 0.f;
  int64_t k = 0;
#ifdef __AVX512F__
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (; k + 16 <= K; k += 16) {
    const __m512 wv = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(wr + k))), 16));
    for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xf + m * K + k), wv, acc[m]);
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
#endif
  for (; k < K; ++k)
    for (int m = 0; m < M; ++m) out[m] += xf[m * K + k] * bf2f(wr[k]);
}

template <int M>
static void small_rows_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out,
                            int64_t K, int64_t N) {
#ifndef __AVX512BF16__
  std::vector<float> xf(M * K);   // [M, K] the inputs widened once
  for (int64_t i = 0; i < M * K; ++i) xf[i] = bf2f(x[i]);
#endif
  at::parallel_for(0, N, 32, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      float s[M];
#ifdef __AVX512BF16__
      bf16_dot_dp<M>(x, w + n * K, K, s);
#else
      bf16_dot_f32<M>(xf.data(), w + n * K, K, s);
#endif
      const float b = bias ? bf2f(bias[n]) : 0.f;
      for (int m = 0; m < M; ++m) out[m * N + n] = f2bf(s[m] + b);
    }
  });
}

// f(std::integral_constant<int, R>) with R = M for 1-3 rows, 4 for the rest: one ladder of
// row-count instantiations for the float32 and bfloat16 kernels.
template <typename F>
static void by_rows(int64_t M, F&& f) {
  switch (M) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

static torch::Tensor linear_small_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16, "linear_small: x is bfloat16, w must be too");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == torch::kBFloat16 && bias->is_contiguous()));
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto out = torch::empty({M, N}, x.options());
  const uint16_t* b = bias.has_value() ? bf_ptr(*bias) : nullptr;
  const uint16_t* xp = bf_ptr(x);
  const uint16_t* wp = bf_ptr(w);
  uint16_t* op = bf_mut(out);
  by_rows(M, [&](auto rows) { small_rows_bf16<decltype(rows)::value>(xp, wp, b, op, K, N); });
  return out;
}

torch::Tensor linear_small(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= 4);
  TORCH_CHECK(w.is_contiguous() && w.size(1) == x.size(1));
  if (x.scalar_type() == torch::kBFloat16) return linear_small_bf16(x, w, bias);
  TORCH_CHECK(x.scalar_type() == torch::kFloat);
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto out = torch::empty({M, N}, x.options());
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  by_rows(M, [&](auto rows) { small_rows<decltype(rows)::value>(xp, wp, b, op, K, N); });
  return out;
}

// bfloat16 x and w: as transformers, normalise in float32, round to bfloat16, then scale
// (a bfloat16 product, rounded again).
static torch::Tensor rms_norm_bf16(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16, "rms_norm: x is bfloat16, w must be too");
  const int64_t T = x.size(0), N = x.size(1), xs = x.stride(0);
  auto out = torch::empty({T, N}, x.options());
  w = w.contiguous();
  const uint16_t* xp = bf_ptr(x);
  const uint16_t* wp = bf_ptr(w);
  uint16_t* op = bf_mut(out);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* r = xp + t * xs;
      float ss = 0.f;
      for (int64_t i = 0; i < N; ++i) ss += bf2f(r[i]) * bf2f(r[i]);
      const float inv = 1.f / std::sqrt(ss / N + (float)eps);
      uint16_t* o = op + t * N;
      for (int64_t i = 0; i < N; ++i) o[i] = f2bf(bf2f(wp[i]) * round_bf(bf2f(r[i]) * inv));
    }
  });
  return out;
}

// x [T, N] (rows may be strided) -> x / sqrt(mean(x^2) + eps) * w, contiguous [T, N].
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1);
  if (x.scalar_type() == torch::kBFloat16) return rms_norm_bf16(x, w, eps);
  TORCH_CHECK(x.scalar_type() == torch::kFloat);
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

// bfloat16: silu in float32 rounded to bfloat16, times up rounded again (torch's two ops).
static torch::Tensor silu_and_mul_bf16(torch::Tensor x) {
  const int64_t T = x.size(0), I = x.size(1) / 2, xs = x.stride(0);
  auto out = torch::empty({T, I}, x.options());
  const uint16_t* xp = bf_ptr(x);
  uint16_t* op = bf_mut(out);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* g = xp + t * xs;
      const uint16_t* u = g + I;
      uint16_t* o = op + t * I;
      for (int64_t i = 0; i < I; ++i) {
        const float gf = bf2f(g[i]);
        o[i] = f2bf(round_bf(gf / (1.f + std::exp(-gf))) * bf2f(u[i]));
      }
    }
  });
  return out;
}

// x [T, 2I] (gate | up) -> silu(gate) * up, [T, I].
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1);
  if (x.scalar_type() == torch::kBFloat16) return silu_and_mul_bf16(x);
  TORCH_CHECK(x.scalar_type() == torch::kFloat);
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

// bfloat16 x, cos/sin as bfloat16 values [P, rot] (the model's tables, cast with it): each
// product rounded to bfloat16, then their sum (transformers' q * cos + rotate_half(q) * sin).
static void rope_one_bf16(torch::Tensor x, const uint16_t* cp, const uint16_t* sp, const int64_t* pos,
                          int64_t rot) {
  const int64_t T = x.size(0), nh = x.size(1), ts = x.stride(0), hs = x.stride(1), half = rot / 2;
  uint16_t* xp = bf_mut(x);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* c = cp + pos[t] * rot;
      const uint16_t* s = sp + pos[t] * rot;
      for (int64_t h = 0; h < nh; ++h) {
        uint16_t* v = xp + t * ts + h * hs;
        for (int64_t i = 0; i < half; ++i) {
          const float a = bf2f(v[i]), b = bf2f(v[i + half]);
          v[i] = f2bf(round_bf(a * bf2f(c[i])) + round_bf(-b * bf2f(s[i])));
          v[i + half] = f2bf(round_bf(b * bf2f(c[i + half])) + round_bf(a * bf2f(s[i + half])));
        }
      }
    }
  });
}

void rotary_embedding_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin,
                       torch::Tensor positions) {
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && cos.is_contiguous() && sin.is_contiguous());
  const int64_t rot = cos.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  if (q.scalar_type() == torch::kBFloat16) {
    TORCH_CHECK(k.scalar_type() == torch::kBFloat16);
    // torch's path casts the tables to q's dtype; a no-op when they were cast with the model.
    cos = cos.to(torch::kBFloat16).contiguous();
    sin = sin.to(torch::kBFloat16).contiguous();
    rope_one_bf16(q, bf_ptr(cos), bf_ptr(sin), pos, rot);
    rope_one_bf16(k, bf_ptr(cos), bf_ptr(sin), pos, rot);
    return;
  }
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k.scalar_type() == torch::kFloat);
  rope_one(q, cos.data_ptr<float>(), sin.data_ptr<float>(), pos, rot);
  rope_one(k, cos.data_ptr<float>(), sin.data_ptr<float>(), pos, rot);
}
"""

FUSED_DTYPES = (torch.float32, torch.bfloat16)

_ops = None
_tried = False


def cpu_ops():
    """The compiled module (rms_norm, silu_and_mul, rotary_embedding_, linear_small), or None."""
    global _ops, _tried
    if not _tried:
        _tried = True
        _ops = build_cpu_extension("pagedllm_cpu_ops_v3", _SOURCE,
                                   ["rms_norm", "silu_and_mul", "rotary_embedding_", "linear_small"])
    return _ops


def fused_cpu_ops():
    """The fused ops for a layer being built now, or None (the layer's torch code): they apply
    where the model is built on the CPU in float32 or bfloat16 (the loader sets torch's default
    device and dtype while it builds). Decided once, when the layer is built."""
    if torch.get_default_device().type != "cpu" or torch.get_default_dtype() not in FUSED_DTYPES:
        return None
    return cpu_ops()
