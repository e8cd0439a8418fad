"""The experts of an MoE layer on the GPU: one grouped Triton matmul per weight (vLLM's
fused_moe_kernel, simplified).

The (token, slot) assignments are sorted by expert and each expert's run padded to a multiple
of BLOCK_M (`align_block_size`, vectorised torch, no host sync: the buffer is sized for the
worst case, T*k + E*(BLOCK_M-1) rows, so a CUDA graph can capture it); every BLOCK_M rows then belong to one expert, so a
program computes a [BLOCK_M, BLOCK_N] tile of that expert's product with `tl.dot`, gathering
its input rows by assignment id. Padding rows (id = T*k) are masked out. gate_up and down are
one launch each; SiLU-and-mul between them; the down launch multiplies each row by its routing
weight, and the k rows of a token are summed in torch.

Each launch is a `KernelLaunch` (kernels/triton_launch.py), so kernels/triton_aot.py
compiles the same description for sm_80 / sm_90 (tests/models/test_moe_triton_aot.py).
Under TRITON_INTERPRET=1 the kernel runs on CPU tensors (the tests compare it with the torch
path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagedllm.kernels.triton_launch import KernelLaunch, launch_options


@triton.jit
def grouped_matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_valid,
    N,
    K,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    TOP_K: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """C[id] = A[id // TOP_K] @ B[e]^T (x weights[id]) for the BLOCK_M assignment ids of this
    program's block, all routed to expert e = expert_ids[block]."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + offs_m)  # [BLOCK_M]
    row_ok = ids < num_valid
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    rows = (ids // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(
            a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        b = tl.load(
            b_ptr + e * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
            mask=k_ok[:, None] & n_ok[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    if MUL_ROUTED_WEIGHT:
        w = tl.load(weights_ptr + ids, mask=row_ok, other=0.0)
        acc = acc * w[:, None]
    out = c_ptr + ids.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_ids [P]: assignment ids grouped by expert, each expert's run
    padded to a multiple of block_m with T*k; expert_ids [P / block_m]: the expert of each
    block), P = T*k + E*(block_m - 1) rounded up to block_m (the worst case, so no host sync).
    Blocks past the last expert's run hold only padding."""
    flat = topk_ids.reshape(-1)
    n, dev = flat.numel(), flat.device
    # scatter_add, not bincount: bincount reads the largest id back to the host, which a
    # CUDA graph capture (decode steps) cannot do.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)  # [E]
    order = torch.argsort(flat, stable=True)  # [n]
    expert = flat[order]
    rank = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[expert]
    size = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((size,), n, dtype=torch.int32, device=dev)
    sorted_ids[(padded_end - padded)[expert] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, size, block_m, device=dev)
    expert_ids = torch.searchsorted(padded_end, block_start, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, expert_ids.to(torch.int32)


def _tiles(dtype: torch.dtype) -> dict:
    # float32 dots run as ieee FMAs with operands in registers: smaller tiles (see docs/gpu.md's
    # AOT notes); 16-bit types take tensor-core tiles.
    if dtype == torch.float32:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, DOT_PRECISION="ieee")
    return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, DOT_PRECISION=None)  # the target's default


def grouped_matmul_launch(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    topk_weights: torch.Tensor,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    top_k: int,
    mul_routed_weight: bool,
    tiles: dict,
) -> KernelLaunch:
    """c [T*k, N] <- a [T*k / top_k, K] rows times b [E, N, K] per expert."""
    N, K = b.shape[1], b.shape[2]
    grid = (sorted_ids.numel() // tiles["BLOCK_M"], triton.cdiv(N, tiles["BLOCK_N"]))
    return KernelLaunch(
        grouped_matmul_kernel,
        grid,
        (a, b, c, topk_weights, sorted_ids, expert_ids, c.shape[0], N, K, *a.stride(), *b.stride(), *c.stride()),
        dict(TOP_K=top_k, MUL_ROUTED_WEIGHT=mul_routed_weight, **tiles),
        launch_options(4),
    )


def fused_experts_launches(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
):
    """The two launches of one MoE layer and their buffers: (gate_up launch, intermediate
    [T*k, 2I], down launch, activated [T*k, I] (to fill between them), out [T*k, H])."""
    T, k = topk_ids.shape
    E, two_i, H = w13.shape
    tiles = _tiles(hidden.dtype)
    sorted_ids, expert_ids = align_block_size(topk_ids, E, tiles["BLOCK_M"])
    weights = topk_weights.reshape(-1).float().contiguous()  # [T*k]
    inter = torch.empty(T * k, two_i, dtype=hidden.dtype, device=hidden.device)
    act = torch.empty(T * k, two_i // 2, dtype=hidden.dtype, device=hidden.device)
    out = torch.empty(T * k, H, dtype=hidden.dtype, device=hidden.device)
    up = grouped_matmul_launch(hidden, w13, inter, weights, sorted_ids, expert_ids, k, False, tiles)
    down = grouped_matmul_launch(act, w2, out, weights, sorted_ids, expert_ids, 1, True, tiles)
    return up, inter, down, act, out


def fused_experts_triton(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """As fused_moe.fused_experts_torch: hidden [T, H] -> [T, H]."""
    T, k = topk_ids.shape
    if T == 0:
        return torch.zeros_like(hidden)
    up, inter, down, act, out = fused_experts_launches(hidden, w13, w2, topk_weights, topk_ids)
    up.launch()
    gate, u = inter.chunk(2, dim=-1)
    torch.mul(F.silu(gate), u, out=act)
    down.launch()
    return out.view(T, k, -1).sum(dim=1)
