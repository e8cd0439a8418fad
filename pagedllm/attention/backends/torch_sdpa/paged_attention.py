"""Paged attention in plain torch: the reference backend, and the SDPA parts the CPU backend
keeps (backends/cpu_attn/paged_attention.py).

The KV cache of one layer is two tensors [num_blocks * block_size, num_kv_heads, head_dim]
(a flat slot axis: slot = block_id * block_size + offset). New K/V are written at
slot_mapping first, then each request reads its past and present through its slots.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pagedllm.attention.backends.torch_sdpa.metadata import AttentionMetadata
from pagedllm.attention.kv_quant import read_kv, write_kv_quantized


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))  # a bfloat16 cache of float32 K/V: rounded
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def write_step_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]],
) -> tuple:
    """This step's k/v into the cache at meta.slot_mapping (quantized for an int8 / fp8 cache)
    -> the cache's tensors (K, V[, K_scale, V_scale])."""
    caches = (k_cache, v_cache) + (tuple(kv_scales) if kv_scales is not None else ())
    if kv_scales is None:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    else:
        write_kv_quantized(k, v, caches, meta.slot_mapping)
    return caches


def attend_decodes(q: torch.Tensor, caches: tuple, meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
    """The decodes' rows of out, by one SDPA call over their gathered slots [Bd, L]."""
    qd = q[meta.decode_token_idx].unsqueeze(2)  # [Bd, H, 1, D]
    kd, vd = read_kv(caches, meta.decode_kv_slots, q.dtype)  # [Bd, L, Hkv, D]
    od = F.scaled_dot_product_attention(
        qd,
        kd.transpose(1, 2),
        vd.transpose(1, 2),
        attn_mask=meta.decode_mask,
        scale=scale,
        enable_gqa=q.shape[1] != caches[0].shape[1],
    )
    out[meta.decode_token_idx] = od.squeeze(2)


def attend_prefills(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    caches: tuple,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    chunks=None,
) -> None:
    """The prefill chunks' rows of out, one SDPA call a chunk (k, v: this step's); chunks:
    those of meta.prefills to run (None: all)."""
    lossy = len(caches) > 2 or caches[0].dtype != q.dtype  # quantized, or rounded to bfloat16
    gqa = q.shape[1] != k.shape[1]
    for p in meta.prefills if chunks is None else chunks:
        qp = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        if p.kv_slots is None and not lossy:  # no past: the chunk's own K/V, plain causal
            kp, vp = k[p.start : p.end], v[p.start : p.end]
        else:  # [seq_len, Hkv, D]; a lossy cache's chunk without past reads its own slots back
            slots = p.kv_slots if p.kv_slots is not None else meta.slot_mapping[p.start : p.end]
            kp, vp = read_kv(caches, slots, q.dtype)
        op = F.scaled_dot_product_attention(
            qp,
            kp.transpose(0, 1).unsqueeze(0),
            vp.transpose(0, 1).unsqueeze(0),
            attn_mask=p.mask,
            is_causal=p.mask is None,
            scale=scale,
            enable_gqa=gqa,
        )
        out[p.start : p.end] = op[0].transpose(0, 1)


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
    """q [T, H, D], k/v [T, Hkv, D] (this step's), caches [S, Hkv, D] -> out [T, H, D]; meta
    built for the layer's sliding window, if it has one (AttentionMetadata.windowed), with
    gathered slots (decode_by_pages / prefill_by_pages off: the CPU backend's metadata goes to
    its own paged_attention). kv_scales: (K_scale, V_scale) [S, Hkv] of an int8 / fp8 cache
    (attention/kv_quant.py); every key and value is then read back quantized, the step's own
    included."""
    caches = write_step_kv(k, v, k_cache, v_cache, meta, kv_scales)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D] contiguous
    if meta.decode_token_idx is not None:
        attend_decodes(q, caches, meta, scale, out)
    attend_prefills(q, k, v, caches, meta, scale, out)
    return out
