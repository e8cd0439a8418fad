"""The SigLIP vision encoder as Idefics3 / SmolVLM use it (transformers' Idefics3VisionTransformer):
a patch convolution, learned position embeddings, pre-norm encoder layers with bidirectional
attention among one image's patches, and a final LayerNorm. Images run whole (no paged cache):
each is one short sequence, encoded once and kept in the runner's encoder cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiglipAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.q_proj, self.k_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.v_proj, self.out_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, P, H = x.shape  # images, patches, hidden

        def heads(t):  # [B, P, H] -> [B, heads, P, head_dim]
            return t.view(B, P, self.num_heads, self.head_dim).transpose(1, 2)

        o = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.out_proj(o.transpose(1, 2).reshape(B, P, H))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, vc: dict) -> None:
        super().__init__()
        hidden, eps = vc["hidden_size"], vc.get("layer_norm_eps", 1e-6)
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.self_attn = SiglipAttention(hidden, vc["num_attention_heads"])
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = nn.Sequential()
        self.mlp.fc1 = nn.Linear(hidden, vc["intermediate_size"])
        self.mlp.act = nn.GELU(approximate="tanh" if "tanh" in vc.get("hidden_act", "gelu_pytorch_tanh") else "none")
        self.mlp.fc2 = nn.Linear(vc["intermediate_size"], hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipVisionTransformer(nn.Module):
    """pixel_values [B, 3, S, S] (S = image_size: whole, unpadded tiles) -> [B, (S/patch)^2, hidden]."""

    def __init__(self, vc: dict) -> None:
        super().__init__()
        hidden, patch = vc["hidden_size"], vc["patch_size"]
        self.image_size, self.patch_size = vc["image_size"], patch
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Conv2d(vc.get("num_channels", 3), hidden, patch, stride=patch)
        self.embeddings.position_embedding = nn.Embedding((self.image_size // patch) ** 2, hidden)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(SiglipEncoderLayer(vc) for _ in range(vc["num_hidden_layers"]))
        self.post_layernorm = nn.LayerNorm(hidden, eps=vc.get("layer_norm_eps", 1e-6))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if pixel_values.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(
                f"pixel_values must be {self.image_size}x{self.image_size} tiles, got {tuple(pixel_values.shape[-2:])}"
            )
        e = self.embeddings
        x = e.patch_embedding(pixel_values).flatten(2).transpose(1, 2)  # [B, patches, hidden]
        x = x + e.position_embedding.weight  # a whole tile: patch i has position i
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
