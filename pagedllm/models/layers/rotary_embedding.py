"""Rotary position embedding (rotate-half convention) with the RoPE scalings of the Llama family."""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedllm.models.layers.fused import fused_layer_ops


def rope_inv_freq(hf: dict, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the attention scaling of the config's RoPE."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    partial = hf.get("partial_rotary_factor", 1.0)
    dim = int(head_dim * partial)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    cfg = {**scaling, **params}
    if kind == "linear":
        inv_freq = inv_freq / cfg["factor"]
    elif kind == "llama3":
        factor, low, high = cfg["factor"], cfg["low_freq_factor"], cfg["high_freq_factor"]
        old_len = cfg["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind == "yarn":
        return yarn_inv_freq(inv_freq, cfg, dim, theta, hf.get("max_position_embeddings"))
    elif kind != "default":
        raise ValueError(f"rope type {kind!r} is not supported (default, linear, llama3, yarn)")
    return inv_freq, 1.0


def yarn_inv_freq(
    inv_freq: torch.Tensor, cfg: dict, dim: int, theta: float, max_positions
) -> tuple[torch.Tensor, float]:
    """YaRN (transformers' _compute_yarn_parameters): frequencies blended between the original
    (extrapolated, fast dims) and divided by `factor` (interpolated, slow dims) over a linear
    ramp between the beta_fast / beta_slow rotation counts; cos/sin scaled by the attention
    factor (DeepSeek: mscale / mscale_all_dim)."""
    old_len = cfg["original_max_position_embeddings"]
    factor = cfg.get("factor") or max_positions / old_len

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = cfg.get("attention_factor")
    if attention is None:
        mscale, mscale_all = cfg.get("mscale"), cfg.get("mscale_all_dim")
        attention = (
            get_mscale(factor, mscale) / get_mscale(factor, mscale_all) if mscale and mscale_all else get_mscale(factor)
        )

    def correction_dim(rotations):
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(cfg.get("beta_fast") or 32), correction_dim(cfg.get("beta_slow") or 1)
    if cfg.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    extrapolation = 1 - ramp
    return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation, float(attention)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed once when the layer is built."""

    def __init__(self, hf: dict, head_dim: int, max_positions: int) -> None:
        super().__init__()
        # Computed in float32 on the CPU, as transformers does, whatever device and dtype the
        # model is built in; then moved and cast to them (the tables are the model's dtype).
        device, dtype = torch.get_default_device(), torch.get_default_dtype()
        with torch.device("cpu"):
            inv_freq, self.attention_scaling = rope_inv_freq(hf, head_dim)
            t = torch.arange(max_positions, dtype=torch.int64).float()
            freqs = torch.outer(t, inv_freq)  # [P, rot/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [P, rot]
            cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        self.register_buffer("cos", cos.to(device, dtype), persistent=False)
        self.register_buffer("sin", sin.to(device, dtype), persistent=False)
        self.rot_dim = emb.shape[-1]
        self.ops = fused_layer_ops()  # C++ or Triton, q and k rotated in place; None: torch

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions [T]; q [T, H, D], k [T, Hkv, D] -> rotated (rotate-half convention)."""
        if self.ops is not None:
            self.ops.rotary_embedding_(q, k, self.cos, self.sin, positions)
            return q, k
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, rot]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin, self.rot_dim), _rotate(k, cos, sin, self.rot_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> torch.Tensor:
    xr, rest = x[..., :rot], x[..., rot:]
    x1, x2 = xr.chunk(2, dim=-1)
    out = xr * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
