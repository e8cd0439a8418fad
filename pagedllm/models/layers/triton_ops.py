"""Fused Triton kernels for the layers' element-wise work on a GPU: RMSNorm (with the residual
add before it), SiLU-and-multiply, RoPE (q and k rotated in place).

In eager torch each of these is 3-12 kernels (casts, pow, mean, add, rsqrt, mul; silu, mul;
index, mul, neg, cat, ...): at batch 1 a decode step of a 16-layer model spends more time in
those ~550 one-microsecond kernels than in its matrix products. Here each is one kernel, one
pass over its rows. The arithmetic is the torch code's of the layers (models/layers/), rounded
to the model's dtype where torch's ops round (RMSNorm normalises in float32 and rounds before
the weight's product; RoPE rounds each product and the sum), so the result equals torch's up to
the order of a row's sum and exp / rsqrt's last bit. The same interface as the fused CPU ops
(models/cpu_ops.py), so the layers choose either when they are built: `fused_gpu_ops()`.
Tested on the CPU under TRITON_INTERPRET=1 (tests/attention/test_triton_layer_ops.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton_launch import next_pow2

FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _warps(elements: int) -> int:
    """Warps of a program that holds `elements` values: ~8 per thread, 1..16 warps."""
    return max(1, min(16, next_pow2(elements) // 256))


@triton.jit
def rms_norm_kernel(
    x_ptr,
    res_ptr,
    out_ptr,
    res_out_ptr,
    w_ptr,
    eps,
    N,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row: [x += residual (rounded to the dtype; written to res_out)], then
    out = w * round(x * rsqrt(mean(x^2) + eps))."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    y = (xf * inv).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_and_mul_kernel(x_ptr, out_ptr, I, stride_x, stride_o, BLOCK: tl.constexpr):
    """out[t, i] = round(silu(gate)) * up, gate = x[t, i], up = x[t, I + i]."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(x_ptr, row, stride_t, stride_h, num_heads, c, s, offs_h, offs_r, r_mask, HALF: tl.constexpr):
    """Rotate-half on x[row, :num_heads, :2 * HALF] in place: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s),
    each product and each sum rounded to x's dtype as torch's ops round them."""
    mask = (offs_h[:, None] < num_heads) & r_mask[None, :]
    p1 = x_ptr + row * stride_t + offs_h[:, None] * stride_h + offs_r[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    o1 = (x1f * c).to(dt).to(tl.float32) - (x2f * s).to(dt).to(tl.float32)
    o2 = (x2f * c).to(dt).to(tl.float32) + (x1f * s).to(dt).to(tl.float32)
    tl.store(p1, o1.to(dt), mask=mask)
    tl.store(p1 + HALF, o2.to(dt), mask=mask)


@triton.jit
def rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """One token: every query and KV head rotated in place by its position's cos / sin row
    (the tables hold cat(freqs, freqs): the first HALF columns suffice)."""
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < HALF
    c = tl.load(cos_ptr + pos * stride_cos + offs_r, mask=r_mask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * stride_cos + offs_r, mask=r_mask, other=0.0).to(tl.float32)[None, :]
    offs_h = tl.arange(0, BLOCK_H)
    _rotate_heads(q_ptr, row, stride_qt, stride_qh, num_heads, c, s, offs_h, offs_r, r_mask, HALF)
    _rotate_heads(k_ptr, row, stride_kt, stride_kh, num_kv_heads, c, s, offs_h, offs_r, r_mask, HALF)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last] with a unit stride in the last dimension (a view when it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch_rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float):
    xs = _rows(x)
    T, N = xs.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [..., N]
    res = _rows(residual) if residual is not None else xs
    res_out = torch.empty_like(out) if residual is not None else out
    if T:
        o2, ro2 = out.view(T, N), res_out.view(T, N)
        block = next_pow2(N)
        rms_norm_kernel[(T,)](
            xs,
            res,
            o2,
            ro2,
            weight,
            float(eps),
            N,
            xs.stride(0),
            res.stride(0),
            o2.stride(0),
            ro2.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=_warps(block),
        )
    return out, res_out


class TritonOps:
    """The layers' fused ops, on the device of their arguments (a GPU; the CPU under
    TRITON_INTERPRET=1)."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [..., N] -> weight * rmsnorm(x), x's dtype."""
        return _launch_rms_norm(x, None, weight, eps)[0]

    @staticmethod
    def fused_add_rms_norm(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual [..., N] -> (rms_norm(x + residual), x + residual), one pass."""
        return _launch_rms_norm(x, residual, weight, eps)

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        """x [..., 2I] (gate | up) -> silu(gate) * up [..., I]."""
        xs = _rows(x)
        T, I = xs.shape[0], xs.shape[1] // 2
        out = torch.empty((*x.shape[:-1], I), dtype=x.dtype, device=x.device)
        if T:
            o2 = out.view(T, I)
            block = min(1024, next_pow2(I))
            silu_and_mul_kernel[(T, triton.cdiv(I, block))](
                xs, o2, I, xs.stride(0), o2.stride(0), BLOCK=block, num_warps=_warps(block)
            )
        return out

    @staticmethod
    def rotary_embedding_(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """q [T, H, D], k [T, Hkv, D] (unit stride in D; views of the QKV product are fine)
        rotated in place over the first rot = cos.shape[-1] dims; cos / sin [P, rot]."""
        T, H, _ = q.shape
        if T == 0:
            return
        assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride() == cos.stride()
        half = cos.shape[-1] // 2
        block_h = next_pow2(max(H, k.shape[1]))
        rotary_kernel[(T,)](
            q,
            k,
            cos,
            sin,
            positions,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos.stride(0),
            H,
            k.shape[1],
            HALF=half,
            BLOCK_R=next_pow2(half),
            BLOCK_H=block_h,
            num_warps=_warps(block_h * next_pow2(half)),
        )


def fused_gpu_ops() -> Optional[TritonOps]:
    """The fused Triton ops for a layer being built now, or None (the layer's torch code): they
    apply where the model is built on a CUDA device in float32 / bfloat16 / float16 (the loader
    sets torch's default device and dtype while it builds). Decided once, when the layer is
    built."""
    if torch.get_default_device().type != "cuda" or torch.get_default_dtype() not in FUSED_DTYPES:
        return None
    return TritonOps()
