"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent cache.

Per token the cache holds only c_kv (the normed latent, kv_lora_rank) and k_pe (the rotated
decoupled RoPE key, qk_rope_head_dim), shared by every head (attention/kv_cache_spec.py
MLAAttentionSpec). The per-head keys and values are the up-projection kv_b_proj of the latent:
k_nope_h = W_UK_h c_kv, v_h = W_UV_h c_kv (kv_b_proj's weight viewed [H, dn + dv, R]). Two
equal ways to attend:

- decompressed (prefill chunks): up-project every latent of the request, then ordinary
  attention with q = [q_nope, q_pe], k = [k_nope, k_pe], v. Costs H * (dn + dv) per cached
  token, paid once for a whole chunk of queries.
- absorbed (decodes, the seeds' "matrix absorption"): q_nope^T W_UK_h c = (W_UK_h^T q_nope)^T c,
  so the query moves into the latent space (q_lat = W_UK_h^T q_nope, [R]) and attends to the
  cache rows [c_kv, k_pe] directly, as multi-query attention with one KV head of size R + dr
  and value c_kv; the output o_lat [H, R] leaves through W_UV_h. Nothing is up-projected per
  cached token.

The torch path serves the CPU backends (their AttentionMetadata); the Triton backend's steps go
to attention/triton_mla.py (the absorbed form for every token, one kernel).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pagedllm.attention.backends.abstract import AttentionBackend
from pagedllm.attention.kv_cache_spec import KVCacheSpec, MLAAttentionSpec
from pagedllm.attention.kv_quant import is_quantized
from pagedllm.attention.layer import Attention
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.mla_absorb import absorb_query, split_kv_b, unabsorb_output
from pagedllm.forward_context import get_forward_context


class MLAAttention(Attention):
    """One MLA layer's attention: owns its latent cache view ((cache,), cache [S, R + dr])."""

    def __init__(self, num_heads: int, scale: float, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int,
                 backend: Optional[AttentionBackend] = None) -> None:
        super().__init__(num_heads, qk_nope_head_dim + qk_rope_head_dim, scale, 1, backend)
        self.kv_lora_rank, self.v_head_dim = kv_lora_rank, v_head_dim
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        if is_quantized(dtype):
            raise ValueError(f"kv_cache_dtype {dtype} is not supported for MLA's latent cache "
                             "(DeepSeek); use kv_cache_dtype 'auto'")
        return MLAAttentionSpec(block_size, self.kv_lora_rank, self.qk_rope_head_dim, dtype)

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor,
                k_pe: torch.Tensor, w_kv_b: torch.Tensor) -> torch.Tensor:
        """q_nope [T, H, dn], q_pe [T, H, dr] (rotated), kv_c [T, R] (normed latent), k_pe [T, dr]
        (rotated), w_kv_b: kv_b_proj's weight [H * (dn + dv), R] -> out [T, H, dv]. This step's
        [kv_c, k_pe] rows are written into the cache at the slot mapping first."""
        if self.kv_cache is None:
            raise RuntimeError("this MLA layer has no KV cache: the runner binds it "
                               "(attention.layer.bind_kv_cache) once the cache is allocated")
        meta = get_forward_context().attn_metadata
        if self.backend.name == "triton":
            from pagedllm.attention.triton_mla import mla_attention_triton
            return mla_attention_triton(q_nope, q_pe, kv_c, k_pe, self.kv_cache[0], w_kv_b,
                                        meta, self.scale)
        return mla_attention_torch(q_nope, q_pe, kv_c, k_pe, self.kv_cache[0], w_kv_b, meta, self.scale)


def mla_decode_torch(q: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor, kv_lora_rank: int,
                     scale: float) -> torch.Tensor:
    """Absorbed attention: q [B, H, R + dr] (absorb_query) over cache rows [B, L, R + dr] (mask
    [B, L], True = attend) -> o_lat [B, H, R]. Multi-query: one shared KV head, value = c_kv."""
    o = F.scaled_dot_product_attention(q.unsqueeze(2), rows.unsqueeze(1),
                                       rows[..., :kv_lora_rank].unsqueeze(1),
                                       attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
    return o.squeeze(2)


def _decode_slots(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The decodes' cache slots [Bd, L] and mask [Bd, L]: gathered by the metadata, or (cpu
    backend's metadata: pages) made here from the block table."""
    if meta.decode_kv_slots is not None:
        return meta.decode_kv_slots, meta.decode_mask[:, 0, 0, :]
    bt, lens, bs = meta.decode_block_table.long(), meta.decode_seq_lens.long(), meta.block_size
    slots = (bt[:, :, None] * bs + torch.arange(bs)).reshape(bt.shape[0], -1)
    valid = torch.arange(slots.shape[1])[None, :] < lens[:, None]
    return torch.where(valid, slots, 0), valid


def mla_attention_torch(q_nope, q_pe, kv_c, k_pe, cache: torch.Tensor, w_kv_b: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The torch path (shapes as MLAAttention.forward; cache [S, R + dr])."""
    T, H, dn = q_nope.shape
    w_uk, w_uv = split_kv_b(w_kv_b, H, dn)
    R, dv = kv_c.shape[-1], w_uv.shape[1]
    new_rows = torch.cat((kv_c, k_pe), dim=-1)                       # [T, R + dr]
    cache.index_copy_(0, meta.slot_mapping, new_rows)
    out = q_nope.new_empty(T, H, dv)
    if meta.decode_token_idx is not None:
        idx = meta.decode_token_idx
        slots, mask = _decode_slots(meta)
        q = absorb_query(q_nope[idx], q_pe[idx], w_uk)               # [Bd, H, R + dr]
        out[idx] = unabsorb_output(mla_decode_torch(q, cache[slots], mask, R, scale), w_uv)
    for p in meta.prefills:
        rows = new_rows[p.start:p.end] if p.kv_slots is None else cache[p.kv_slots]   # [S, R + dr]
        S = rows.shape[0]
        kv = F.linear(rows[:, :R], w_kv_b).view(S, H, dn + dv)          # decompress
        k = torch.cat((kv[..., :dn], rows[:, None, R:].expand(S, H, rows.shape[1] - R)), dim=-1)
        q = torch.cat((q_nope[p.start:p.end], q_pe[p.start:p.end]), dim=-1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                           kv[..., dn:].transpose(0, 1), attn_mask=p.mask,
                                           is_causal=p.mask is None, scale=scale)
        out[p.start:p.end] = o.transpose(0, 1)
    return out
