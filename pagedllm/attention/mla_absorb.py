"""MLA's matrix absorption (DeepSeek-V2/V3): kv_b_proj split into W_UK / W_UV, the query taken
into the latent space through W_UK and the attention output back out through W_UV, shared by the
torch path (backends/torch_sdpa/mla.py) and the Triton kernel's wrapper (backends/triton_attn/mla.py)."""

from __future__ import annotations

import torch


def split_kv_b(w_kv_b: torch.Tensor, num_heads: int, qk_nope_head_dim: int):
    """kv_b_proj's weight [H * (dn + dv), R] -> views W_UK [H, dn, R], W_UV [H, dv, R]."""
    w = w_kv_b.view(num_heads, -1, w_kv_b.shape[-1])
    return w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:]


def absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """[q_lat, q_pe]: q_nope [B, H, dn] through W_UK [H, dn, R] into the latent space -> [B, H, R + dr]."""
    q_lat = torch.einsum("bhd,hdr->bhr", q_nope, w_uk)
    return torch.cat((q_lat, q_pe), dim=-1)


def unabsorb_output(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o_lat [B, H, R] (attention-weighted latents) through W_UV [H, dv, R] -> [B, H, dv]."""
    return torch.einsum("bhr,hvr->bhv", o_lat, w_uv)
