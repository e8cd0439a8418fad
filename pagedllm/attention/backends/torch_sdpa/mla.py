"""MLA's torch path (the torch and CPU backends; attention/mla_attention.py explains the two
forms): prefill chunks decompressed, decodes absorbed, over the paged latent cache [S, R + dr]
with the torch backend's metadata (gathered slots, or the CPU backend's pages)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.backends.torch_sdpa.metadata import AttentionMetadata
from pagedllm.attention.mla_absorb import absorb_query, split_kv_b, unabsorb_output


def mla_decode_torch(
    q: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor, kv_lora_rank: int, scale: float
) -> torch.Tensor:
    """Absorbed attention: q [B, H, R + dr] (absorb_query) over cache rows [B, L, R + dr] (mask
    [B, L], True = attend) -> o_lat [B, H, R]. Multi-query: one shared KV head, value = c_kv."""
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        rows.unsqueeze(1),
        rows[..., :kv_lora_rank].unsqueeze(1),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
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


def mla_attention_torch(
    q_nope, q_pe, kv_c, k_pe, cache: torch.Tensor, w_kv_b: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """The torch path (shapes as MLAAttention.forward; cache [S, R + dr])."""
    T, H, dn = q_nope.shape
    w_uk, w_uv = split_kv_b(w_kv_b, H, dn)
    R, dv = kv_c.shape[-1], w_uv.shape[1]
    new_rows = torch.cat((kv_c, k_pe), dim=-1)  # [T, R + dr]
    cache.index_copy_(0, meta.slot_mapping, new_rows)
    out = q_nope.new_empty(T, H, dv)
    if meta.decode_token_idx is not None:
        idx = meta.decode_token_idx
        slots, mask = _decode_slots(meta)
        q = absorb_query(q_nope[idx], q_pe[idx], w_uk)  # [Bd, H, R + dr]
        out[idx] = unabsorb_output(mla_decode_torch(q, cache[slots], mask, R, scale), w_uv)
    for p in meta.prefills:
        rows = new_rows[p.start : p.end] if p.kv_slots is None else cache[p.kv_slots]  # [S, R + dr]
        S = rows.shape[0]
        kv = F.linear(rows[:, :R], w_kv_b).view(S, H, dn + dv)  # decompress
        k = torch.cat((kv[..., :dn], rows[:, None, R:].expand(S, H, rows.shape[1] - R)), dim=-1)
        q = torch.cat((q_nope[p.start : p.end], q_pe[p.start : p.end]), dim=-1)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            kv[..., dn:].transpose(0, 1),
            attn_mask=p.mask,
            is_causal=p.mask is None,
            scale=scale,
        )
        out[p.start : p.end] = o.transpose(0, 1)
    return out
