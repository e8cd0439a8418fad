"""MLA on the GPU path: the latent (absorbed) attention in one Triton kernel, for every query
token of a step, decodes and prefill chunks alike (attention/mla_attention.py explains the
absorption). The query is absorbed and the output un-absorbed with torch (batched matmuls over
the heads); the kernel reads the paged latent cache [S, R + dr] through the block table:

- ``mla_attention_kernel``: one program per (block of BLOCK_Q query tokens of one request,
  block of BLOCK_H heads), the rows (token, head) flattened into 16 (tl.dot's minimum M). The
  request is found by the unified kernel's binary search (``_query_block``: grid
  num_tokens // BLOCK_Q + num_reqs, no device value); each row attends the keys 0 ..= its
  position, in tiles of BLOCK_N cache rows: s = q_lat . c_kv + q_pe . k_pe (two ``tl.dot``s
  over one row load), online softmax in float32 (base 2), acc += p . c_kv. The value is the
  latent itself, so one tile read serves scores and output for every row (MQA).

Prefill chunks are absorbed too (no decompression on this path): more FLOPs per cached key
than up-projecting for a long chunk, but one kernel and no [S, H, dn + dv] temporaries.
Under ``TRITON_INTERPRET=1`` it runs on CPU tensors (tests/attention/test_mla_attention.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.attention.backends.triton_attn.kernels import _query_block
from pagedllm.attention.backends.triton_attn.metadata import TritonAttentionMetadata
from pagedllm.attention.backends.triton_attn.paged_attention import write_kv
from pagedllm.attention.mla_absorb import absorb_query, split_kv_b, unabsorb_output
from pagedllm.kernels.triton_launch import KernelLaunch, launch_options, next_pow2


@triton.jit
def mla_attention_kernel(
    q_lat_ptr,
    q_pe_ptr,
    cache_ptr,
    out_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale,
    num_reqs,
    stride_qlt,
    stride_qlh,
    stride_pet,
    stride_peh,
    stride_cs,
    stride_ot,
    stride_oh,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    KV_LORA_RANK: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    R_PAD: tl.constexpr,
    DR_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    head_block = tl.program_id(1)
    req, q_start, q_len, q_block_local, context_len = _query_block(
        query_start_loc_ptr, seq_lens_ptr, q_block, num_reqs, BLOCK_Q
    )
    if q_block_local * BLOCK_Q >= q_len:  # past this request's last query block
        return

    # Rows: (query token of the block, head of the head block) flattened.
    offs_m = tl.arange(0, BLOCK_Q * BLOCK_H)
    q_pos = q_block_local * BLOCK_Q + offs_m // BLOCK_H
    heads = head_block * BLOCK_H + offs_m % BLOCK_H
    row_valid = (q_pos < q_len) & (heads < NUM_HEADS)
    token = (q_start + q_pos).to(tl.int64)
    offs_r = tl.arange(0, R_PAD)
    offs_p = tl.arange(0, DR_PAD)
    r_mask = offs_r < KV_LORA_RANK
    p_mask = offs_p < ROPE_DIM
    q_lat = tl.load(
        q_lat_ptr + token[:, None] * stride_qlt + heads[:, None] * stride_qlh + offs_r[None, :],
        mask=row_valid[:, None] & r_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, R_PAD]
    q_pe = tl.load(
        q_pe_ptr + token[:, None] * stride_pet + heads[:, None] * stride_peh + offs_p[None, :],
        mask=row_valid[:, None] & p_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, DR_PAD]
    q_abs = context_len + q_pos  # each row attends keys 0 ..= q_abs
    kv_len = context_len + tl.minimum((q_block_local + 1) * BLOCK_Q, q_len)

    qk_scale = scale * 1.4426950408889634  # exp(x) = exp2(x * log2(e))
    m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_H, R_PAD], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for tile in range(0, tl.cdiv(kv_len, BLOCK_N)):
        key_pos = tile * BLOCK_N + offs_n
        key_valid = key_pos < kv_len
        phys = tl.load(bt_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        row = cache_ptr + (phys * BLOCK_SIZE + key_pos % BLOCK_SIZE) * stride_cs  # [BLOCK_N]
        c = tl.load(
            row[:, None] + offs_r[None, :], mask=key_valid[:, None] & r_mask[None, :], other=0.0
        )  # [BLOCK_N, R_PAD]
        pe = tl.load(
            row[None, :] + KV_LORA_RANK + offs_p[:, None], mask=key_valid[None, :] & p_mask[:, None], other=0.0
        )  # [DR_PAD, BLOCK_N]
        s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        s += tl.dot(q_pe, pe, input_precision=DOT_PRECISION)
        attend = key_valid[None, :] & (key_pos[None, :] <= q_abs[:, None]) & row_valid[:, None]
        s = tl.where(attend, s * qk_scale, float("-inf"))  # [BLOCK_M, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with nothing to attend so far keeps m = -inf; subtract 0 instead to avoid nan.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + heads[:, None] * stride_oh + offs_r[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & r_mask[None, :],
    )


ROWS = 16  # query rows (token x head) of one program: tl.dot's minimum M


def mla_attention_launch(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    meta: TritonAttentionMetadata,
    scale: float,
    out: torch.Tensor,
    fp32_precision: str = "ieee",
) -> KernelLaunch:
    """q_lat [T, H, R], q_pe [T, H, dr] (last dims contiguous), cache [S, R + dr] -> out
    (o_lat [T, H, R]). A program takes BLOCK_H heads of BLOCK_Q tokens: all of a rank's heads
    of several tokens when it has fewer than 16 (prefill chunks), else 16 heads of one token."""
    T, H, R = q_lat.shape
    dr = q_pe.shape[-1]
    assert cache.stride(-1) == 1 and q_lat.stride(-1) == 1 and q_pe.stride(-1) == 1 and out.stride(-1) == 1
    block_h = min(next_pow2(H), ROWS)
    block_q = min(ROWS // block_h, next_pow2(meta.max_query_len))
    block_h = ROWS // block_q if block_q > 1 else max(block_h, ROWS)  # fill the 16 rows
    bt = meta.block_table
    exact = q_lat.dtype == torch.float32 and fp32_precision == "ieee"
    return KernelLaunch(
        mla_attention_kernel,
        (T // block_q + meta.num_reqs, triton.cdiv(H, block_h)),
        (
            q_lat,
            q_pe,
            cache,
            out,
            bt,
            meta.query_start_loc,
            meta.seq_lens,
            float(scale),
            meta.num_reqs,
            q_lat.stride(0),
            q_lat.stride(1),
            q_pe.stride(0),
            q_pe.stride(1),
            cache.stride(0),
            out.stride(0),
            out.stride(1),
            bt.stride(0),
        ),
        dict(
            NUM_HEADS=H,
            KV_LORA_RANK=R,
            ROPE_DIM=dr,
            R_PAD=next_pow2(max(16, R)),
            DR_PAD=next_pow2(max(16, dr)),
            BLOCK_SIZE=meta.block_size,
            BLOCK_Q=block_q,
            BLOCK_H=block_h,
            BLOCK_N=16 if exact or R > 256 else 32,
            DOT_PRECISION=fp32_precision if q_lat.dtype == torch.float32 else None,
        ),
        launch_options(8 if R > 256 else 4, num_stages=2),
    )


def mla_attention_triton(
    q_nope, q_pe, kv_c, k_pe, cache: torch.Tensor, w_kv_b: torch.Tensor, meta: TritonAttentionMetadata, scale: float
) -> torch.Tensor:
    """MLAAttention.forward on the Triton backend (same shapes as the torch path)."""
    T, H, dn = q_nope.shape
    w_uk, w_uv = split_kv_b(w_kv_b, H, dn)
    rows = torch.cat((kv_c, k_pe), dim=-1)[:, None]  # [T, 1, R + dr]
    # The MLA row as a one-head K (and the same as V: written twice, equal): reshape_and_cache
    # skips padding slots (-1) as a captured step needs.
    write_kv(rows, rows, cache[:, None], cache[:, None], meta.slot_mapping)
    q = absorb_query(q_nope, q_pe, w_uk)  # [T, H, R + dr]
    R = kv_c.shape[-1]
    o_lat = q.new_empty(T, H, R)
    if T:
        mla_attention_launch(q[..., :R], q[..., R:], cache, meta, scale, o_lat).launch()
    return unabsorb_output(o_lat, w_uv)
