"""FP8 weights on the GPU: `Fp8LinearMethod` keeps a linear's weight as
float8_e4m3fn [N, K] with one float32 factor per [bn, bk] block (DeepSeek-V3's
`weight_scale_inv` layout, models/layers/quantization/fp8.py) and computes with a Triton block-FP8 GEMM:
each program takes a [BLOCK_M, BLOCK_N] tile of the output, streams K in BLOCK_K steps
(BLOCK_K divides bk, BLOCK_N divides bn, so one factor per output column and step), widens
the FP8 weight tile to the activations' dtype (exact), `tl.dot`s it in float32 and scales the
partial sum by its block's factor. Half the weight bytes of bf16, the activations unquantized
(W8A16): decode, which streams the weights, gains what a W8A8 `torch._scaled_mm` would, with
no activation rounding.

Where it applies (`use_fp8_linears`): a CUDA device of compute capability 8.9+ (FP8 types),
the projections FP8 checkpoints quantize (FP8_LINEARS). The loader upcasts the checkpoint's
blocks to float32 while loading (the fused layers' weight loaders then place shards as
usual) and `process_weights_after_loading` quantizes each layer back to the same blocks:
a block whose largest value is 448 x its factor (as quantizers write them) returns the
checkpoint's bytes. Tested under TRITON_INTERPRET=1 against float32 math on the dequantized
weight; compiled for sm_90 by kernels/triton_aot.py (tests/models/test_fp8_linear.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import nn

from pagedllm.kernels.triton_launch import KernelLaunch, launch_options
from pagedllm.models.layers.linear_method import LinearMethodBase

FP8_MAX = 448.0
# The parallel linears FP8 checkpoints (DeepSeek-V3, Llama / Qwen FP8) quantize, by module name.
FP8_LINEARS = frozenset(
    {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa"}
)


@triton.jit
def block_fp8_matmul_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    stride_om,
    stride_on,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """out [M, N] = x [M, K] @ (w [N, K] fp8 x s [N / GROUP_N, K / GROUP_K] per block).T"""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    s_rows = s_ptr + (offs_n // GROUP_N).to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + kk[None, :] * stride_xk,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BM, BK]
        w = tl.load(
            w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + kk[:, None] * stride_wk,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        )  # [BK, BN] fp8
        s = tl.load(s_rows + (k0 // GROUP_K) * stride_sk, mask=n_mask, other=0.0)  # [BN]
        acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION) * s[None, :]
    tl.store(
        out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on,
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def block_fp8_matmul_launch(
    x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], out: torch.Tensor
) -> KernelLaunch:
    """x [M, K] (float32 / bf16 / fp16), w [N, K] float8_e4m3fn, scale_inv [ceil(N / bn),
    ceil(K / bk)] float32 -> out [M, N] of x's dtype."""
    M, K = x.shape
    N = w.shape[0]
    bn, bk = block
    exact_fp32 = x.dtype == torch.float32  # ieee dots run as FMAs: narrower tiles
    block_n = min(32 if exact_fp32 else 64, bn)
    block_k = min(32 if exact_fp32 else 64, bk)
    if bn % block_n or bk % block_k:
        raise ValueError(f"FP8 weight blocks {list(block)} must be multiples of {block_n} x {block_k}")
    block_m = 16 if M <= 16 else (32 if M <= 32 or exact_fp32 else 64)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    return KernelLaunch(
        block_fp8_matmul_kernel,
        grid,
        (x, w, scale_inv, out, M, N, K, *x.stride(), *w.stride(), *scale_inv.stride(), *out.stride()),
        dict(
            GROUP_N=bn,
            GROUP_K=bk,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            DOT_PRECISION="ieee" if exact_fp32 else None,
        ),
        launch_options(8 if exact_fp32 and block_m >= 32 else 4, num_stages=3),
    )


def block_fp8_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """F.linear with a block-FP8 weight: x [..., K] -> [..., N]."""
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty(x2.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block_fp8_matmul_launch(x2, w, scale_inv, block, out).launch()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], w.shape[0])


def quantize_block_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (float8_e4m3fn [N, K], scale_inv [ceil(N / bn), ceil(K / bk)] float32): each
    block's largest magnitude becomes 448 (quantization/fp8.dequantize_block_fp8 inverts it)."""
    N, K = w.shape
    bn, bk = block
    nb, kb = -(-N // bn), -(-K // bk)
    padded = torch.zeros(nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    padded[:N, :K] = w.float()
    blocks = padded.view(nb, bn, kb, bk)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(1e-12)  # [nb, kb]
    q = (blocks / scale[:, None, :, None]).view(nb * bn, kb * bk)[:N, :K].to(torch.float8_e4m3fn)
    return q.contiguous(), scale


class Fp8LinearMethod(LinearMethodBase):
    """The layer's weight loaded in float32 (upcast from the checkpoint's blocks), then kept as
    block FP8 (`weight` float8_e4m3fn, `weight_scale_inv`) for the Triton GEMM."""

    def __init__(self, block: tuple[int, int]) -> None:
        self.block = tuple(block)

    def create_weights(self, layer, input_size, output_size):
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=torch.float32), requires_grad=False)

    def process_weights_after_loading(self, layer):
        q, s = quantize_block_fp8(layer.weight.data, self.block)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale_inv = nn.Parameter(s, requires_grad=False)

    def apply(self, layer, x, bias=None):
        return block_fp8_linear(x, layer.weight, layer.weight_scale_inv, self.block, bias)


def fp8_supported(device: torch.device) -> bool:
    """FP8 types (and Triton's conversions) need compute capability 8.9+."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def use_fp8_linears(model: nn.Module, block: tuple[int, int]) -> int:
    """Before loading: give the model's FP8_LINEARS an Fp8LinearMethod (a float32 weight of the
    same shape for the loader to fill) -> how many layers took it."""
    n = 0
    for name, m in model.named_modules():
        if name.rsplit(".", 1)[-1] in FP8_LINEARS and hasattr(m, "linear_method"):
            out_features, in_features = m.weight.shape
            m.linear_method = Fp8LinearMethod(block)
            m.linear_method.create_weights(m, in_features, out_features)
            m.weight.weight_loader = m.weight_loader
            n += 1
    return n
