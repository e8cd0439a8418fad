"""The CPU backend's forward: the torch backend's paged attention whose decodes and prefill
chunks read K/V through the block table with the C++ kernels (kernels.py) where the metadata
carries pages (decode_by_pages / prefill_by_pages) and the kernel takes the cache; the rest
keeps the torch backend's SDPA."""

from __future__ import annotations

from typing import Optional

import torch

from pagedllm.attention.backends.cpu_attn.kernels import decode_kernel, prefill_kernel
from pagedllm.attention.backends.torch_sdpa.metadata import AttentionMetadata
from pagedllm.attention.backends.torch_sdpa.paged_attention import attend_decodes, attend_prefills, write_step_kv


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """As torch_sdpa.paged_attention.paged_attention (same shapes), for metadata built with or
    without pages."""
    caches = write_step_kv(k, v, k_cache, v_cache, meta, kv_scales)

    def decode(qd: torch.Tensor) -> torch.Tensor:  # the C++ kernel reads the pages directly
        return decode_kernel()(
            qd,
            k_cache,
            v_cache,
            meta.decode_block_table,
            meta.decode_seq_lens,
            meta.block_size,
            scale,
            meta.sliding_window or 0,
            *caches[2:],
        )

    paged_decode = meta.decode_block_table is not None
    if paged_decode and meta.all_decode and len(meta.decode_seq_lens) == q.shape[0]:
        return decode(q)  # every token a decode query, in token order: no gather, no scatter
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D] contiguous
    if paged_decode:
        out[meta.decode_token_idx] = decode(q[meta.decode_token_idx])
    elif meta.decode_token_idx is not None:
        attend_decodes(q, caches, meta, scale, out)
    pages = meta.prefill_pages
    kernel = prefill_kernel(q.dtype, q.shape[2]) if pages is not None and kv_scales is None else None
    if kernel is not None:  # every chunk in one call, through the block table, written into out
        kernel(
            q,
            k_cache,
            v_cache,
            out,
            pages.q_start,
            pages.q_len,
            pages.seq_lens,
            pages.block_table,
            meta.block_size,
            scale,
            meta.sliding_window or 0,
        )
        attend_prefills(q, k, v, caches, meta, scale, out, meta.masked_prefills)  # images' chunks
        return out
    attend_prefills(q, k, v, caches, meta, scale, out)
    return out
