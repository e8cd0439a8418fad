"""LoRA's shrink and expand as Triton kernels (punica's BGMV: each token gathers its own
adapter's matrices by its slot), for the GPU path; tested under TRITON_INTERPRET=1 against
punica.add_lora_torch and compiled for sm_80 / sm_90 through kernels/triton_aot.py.

shrink: h[t, :R] = x[t] A[slot_t]^T (float32), grid (T,), K walked in BLOCK_K tiles.
expand: y[t, n] += h[t] B[slot_t, n]^T, grid (T, cdiv(N, BLOCK_N)). A token of slot -1 (the
base model) loads nothing and writes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton_launch import KernelLaunch, launch_options, next_pow2


@triton.jit
def _token_slot(slot_ptr, R):
    """(this program's token, its slot, its rank): a base token (slot -1) gets rank 0, so that
    every mask below is false and it loads and stores nothing."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    return t.to(tl.int64), tl.maximum(slot, 0).to(tl.int64), tl.where(slot >= 0, R, 0)


@triton.jit
def lora_shrink_kernel(
    x_ptr,
    a_ptr,
    slot_ptr,
    h_ptr,
    K,
    R,
    stride_xt,
    stride_as,
    stride_ar,
    stride_ht,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    t, s, R = _token_slot(slot_ptr, R)
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + t * stride_xt + k, mask=k < K, other=0.0).to(tl.float32)
        av = tl.load(
            a_ptr + s * stride_as + r[:, None] * stride_ar + k[None, :],
            mask=(r[:, None] < R) & (k[None, :] < K),
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(av * xv[None, :], axis=1)
    tl.store(h_ptr + t * stride_ht + r, acc, mask=r < R)


@triton.jit
def lora_expand_kernel(
    h_ptr,
    b_ptr,
    slot_ptr,
    y_ptr,
    N,
    R,
    stride_ht,
    stride_bs,
    stride_bn,
    stride_yt,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    t, s, R = _token_slot(slot_ptr, R)
    N = tl.where(R > 0, N, 0)  # a base token: y is neither read nor written
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    hv = tl.load(h_ptr + t * stride_ht + r, mask=r < R, other=0.0)
    bv = tl.load(
        b_ptr + s * stride_bs + n[:, None] * stride_bn + r[None, :], mask=(n[:, None] < N) & (r[None, :] < R), other=0.0
    ).to(tl.float32)
    delta = tl.sum(bv * hv[None, :], axis=1)
    y_at = y_ptr + t * stride_yt + n
    yv = tl.load(y_at, mask=n < N, other=0.0)
    tl.store(y_at, (yv.to(tl.float32) + delta).to(yv.dtype), mask=n < N)


def lora_launches(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor
) -> tuple[KernelLaunch, KernelLaunch, torch.Tensor]:
    """(shrink, expand, h): the two launches that add each token's adapter delta into y [T, N]
    in place. x [T, K] and lora_a [L, R, K] contiguous, lora_b [L, N, R] with unit stride along R
    (layers.py passes a permuted view), token_slots [T] int32; h [T, R] float32 is the shrink's
    output."""
    T, K = x.shape
    _, R, _ = lora_a.shape
    N = lora_b.shape[1]
    h = torch.empty(T, R, dtype=torch.float32, device=x.device)  # [T, R]
    block_r = max(next_pow2(R), 16)
    block_k = max(16, min(256, 4096 // block_r))
    block_n = max(16, min(128, 4096 // block_r))
    shrink = KernelLaunch(
        lora_shrink_kernel,
        (T,),
        (x, lora_a, token_slots, h, K, R, x.stride(0), lora_a.stride(0), lora_a.stride(1), h.stride(0)),
        dict(BLOCK_K=block_k, BLOCK_R=block_r),
        launch_options(4),
    )
    expand = KernelLaunch(
        lora_expand_kernel,
        (T, triton.cdiv(N, block_n)),
        (h, lora_b, token_slots, y, N, R, h.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0)),
        dict(BLOCK_N=block_n, BLOCK_R=block_r),
        launch_options(4),
    )
    return shrink, expand, h


def add_lora_triton(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor
) -> None:
    """punica.add_lora_torch's result, by token slot, on the GPU (or under the interpreter)."""
    if x.shape[0] == 0:
        return
    shrink, expand, _ = lora_launches(y, x.contiguous(), lora_a, lora_b, token_slots)
    shrink.launch()
    expand.launch()
