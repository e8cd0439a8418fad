// Fused element-wise ops (RMSNorm, SiLU-and-multiply, RoPE) and the row-streaming product for
// 1-8 rows (linear_small); float32 and bfloat16 (see models/cpu_ops.py).
#include <ATen/Parallel.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu_types.h"
#include "ops.h"

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
static inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// x [M, K] (M <= 8 rows, contiguous), w [N, K] contiguous -> x w^T (+ bias) [M, N]. A decode
// step at batch 1 is bound by reading the weights: each thread streams its own run of rows
// once, front to back, and dots each with the M inputs held in L1. Each output row's sum runs
// in the same order whatever M is, so a row's result does not depend on the rows beside it (a
// verification step's k + 1 rows equal k + 1 one-row decode steps, bit for bit).
template <int M>
static void small_rows(const float* x, const float* w, const float* bias, float* out, int64_t K, int64_t N) {
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
#elif defined(__AVX2__) && defined(__FMA__)
      __m256 acc[M];
      for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
      for (; k + 8 <= K; k += 8) {
        const __m256 wv = _mm256_loadu_ps(wr + k);
        for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), wv, acc[m]);
      }
      for (int m = 0; m < M; ++m) tail[m] = hsum256(acc[m]);
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
    const __m512 wv = load16(wr + k);
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
  std::vector<float> xf(M * K);  // [M, K] the inputs widened once
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

// f(std::integral_constant<int, R>) with R = M for 1-7 rows, 8 for the rest: one ladder of
// row-count instantiations for the float32 and bfloat16 kernels.
template <typename F>
static void by_rows(int64_t M, F&& f) {
  switch (M) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
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
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= 8);
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

// The float32 rows of rms_norm and silu_and_mul, out of line: the GGUF step's hand-offs call the
// same code, so their sums are the same instructions as the eager ops' (bit for bit).
void rms_norm_row(const float* x, const float* w, float* out, int64_t N, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < N; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / N + eps);
  for (int64_t i = 0; i < N; ++i) out[i] = w[i] * (x[i] * inv);
}

void silu_and_mul_row(const float* gate, const float* up, float* out, int64_t I) {
  for (int64_t i = 0; i < I; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
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
    for (int64_t t = begin; t < end; ++t) rms_norm_row(xp + t * xs, wp, op + t * N, N, (float)eps);
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
    for (int64_t t = begin; t < end; ++t) silu_and_mul_row(xp + t * xs, xp + t * xs + I, op + t * I, I);
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
