"""Qwen2-VL's vision transformer: patches of 2 frames x P x P pixels embedded by a linear map
(the checkpoint's Conv3d with stride = kernel, flattened), blocks of bidirectional attention
within each image with a 2-D rotary embedding (row and column of each patch), and a patch merger
that concatenates each merge x merge group of neighbouring patches into one text-width token."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def vision_patch_positions(t: int, h: int, w: int, merge: int) -> torch.Tensor:
    """-> [t*h*w, 2] (row, column) of each patch in the processor's order: merge x merge blocks
    row-major, patches row-major within a block, repeated for each frame group."""
    rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
    cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
    pos = torch.stack([rows.transpose(1, 2).reshape(-1), cols.transpose(1, 2).reshape(-1)], dim=-1)
    return pos.repeat(t, 1)


def input_channels(vc: dict) -> int:
    """The patch embedding's input channels. transformers' Qwen2VLVisionConfig and
    Qwen2_5_VLVisionConfig read `in_channels` (default 3); Qwen's released config.json files name
    it `in_chans`, which transformers keeps as an extra attribute it never reads. Either, where
    given, must be 3: the image processor's patches are RGB (3 x 2 x P x P values each)."""
    for field in ("in_channels", "in_chans"):
        if vc.get(field, 3) != 3:
            raise ValueError(f"vision_config.{field} {vc[field]!r} is not supported: the images are RGB (3 channels)")
    return 3


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """x [N, dim] (the patches of every image); cos/sin [N, 1, head_dim] float32; lengths:
        each image's patch count (attention stays within an image)."""
        N = x.shape[0]
        q, k, v = self.qkv(x).view(N, 3, self.num_heads, self.head_dim).unbind(1)  # [N, H, D] each
        # The rotation in float32, as transformers does, whatever the model's dtype.
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        out = [
            F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1))
            for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths))
        ]
        return self.proj(torch.cat(out, dim=1).transpose(0, 1).reshape(N, -1))


class VisionMLP(nn.Module):
    """Qwen2-VL's: fc1, quick_gelu (or gelu), fc2."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        if act not in ("quick_gelu", "gelu"):
            raise ValueError(f"vision_config.hidden_act {act!r} is not supported (quick_gelu, gelu)")
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(h * torch.sigmoid(1.702 * h) if self.act == "quick_gelu" else F.gelu(h))


class VisionBlock(nn.Module):
    """Pre-norm attention and MLP, each with its residual; norm: the norm's class (dim, eps)."""

    def __init__(self, dim: int, num_heads: int, mlp: nn.Module, norm) -> None:
        super().__init__()
        self.norm1 = norm(dim, 1e-6)
        self.norm2 = norm(dim, 1e-6)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = mlp

    def forward(self, x, cos, sin, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each merge x merge group of neighbouring patches (consecutive rows) normed, concatenated
    and projected to the text width."""

    def __init__(self, dim: int, out_dim: int, merge: int, norm) -> None:
        super().__init__()
        merged = dim * merge**2
        self.ln_q = norm(dim, 1e-6)
        self.mlp = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, dim] -> [N / merge^2, out_dim]."""
        return self.mlp(self.ln_q(x).view(-1, self.mlp[0].in_features))


class Qwen2VLVisionTransformer(nn.Module):
    def __init__(self, vc: dict) -> None:
        super().__init__()
        dim = vc.get("embed_dim", 1280)
        mlp_hidden, act = int(dim * vc.get("mlp_ratio", 4)), vc.get("hidden_act", "quick_gelu")
        self.build(vc, dim, vc["hidden_size"], nn.LayerNorm, lambda: VisionMLP(dim, mlp_hidden, act))

    def build(self, vc: dict, dim: int, out_dim: int, norm, make_mlp) -> None:
        """The parts Qwen2-VL and Qwen2.5-VL share, with their norm's class and MLP."""
        heads = vc.get("num_heads", 16)
        self.merge = vc.get("spatial_merge_size", 2)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Module()
        kernel = (vc.get("temporal_patch_size", 2), vc.get("patch_size", 14), vc.get("patch_size", 14))
        self.patch_embed.proj.weight = nn.Parameter(torch.empty(dim, input_channels(vc), *kernel))
        head_dim = dim // heads
        theta = (vc.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        # head_dim/4 frequencies each for the row and the column.
        self.register_buffer(
            "inv_freq",
            1.0 / theta ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2)),
            persistent=False,
        )
        self.blocks = nn.ModuleList(VisionBlock(dim, heads, make_mlp(), norm) for _ in range(vc.get("depth", 32)))
        self.merger = PatchMerger(dim, out_dim, self.merge, norm)

    def embed(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]):
        """patches [N, C*2*P*P] -> (x [N, dim], cos, sin [N, 1, head_dim] float32 of each
        patch's row and column)."""
        w = self.patch_embed.proj.weight
        x = F.linear(patches.to(w.dtype), w.flatten(1))  # [N, dim]
        pos = torch.cat([vision_patch_positions(*g, self.merge) for g in grids]).to(x.device)  # [N, 2]
        freqs = (pos.unsqueeze(-1).float() * self.inv_freq.to(x.device)).flatten(1)  # [N, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [N, 1, head_dim]
        return x, emb.cos(), emb.sin()

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """patches [N, C*2*P*P] of every image in order, grids: each image's (t, h, w) in
        patches -> [N / merge^2, text hidden] (each image's tokens in order)."""
        x, cos, sin = self.embed(patches, grids)
        lengths = [t * h * w for t, h, w in grids]
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.merger(x)
