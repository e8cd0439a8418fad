"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration): Qwen2-VL's text model, M-RoPE positions and
patch merger (models/qwen2_vl.py, qwen2_vl_vision.py), with a vision transformer whose blocks
use RMSNorm and a gated SiLU MLP and attend within windows of window_size pixels square (the
merged groups of each window made contiguous), except the blocks at fullatt_block_indexes, which
attend over each whole image. Video (second_per_grid_ts) is not taken: for an image the temporal
positions are Qwen2-VL's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.models.layers.layernorm import RMSNorm
from pagedllm.models.qwen2_vl import Qwen2VLForConditionalGeneration
from pagedllm.models.qwen2_vl_vision import Qwen2VLVisionTransformer


def window_order(grids: list[tuple[int, int, int]], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """-> (order [N / merge^2]: the merged groups of every image, window by window (windows
    row-major, groups row-major within a window), as indices into the processor's order; the
    patch count of each non-empty window, in that order). window: a window's side in merged
    groups. A loop over the images, each vectorised."""
    order, lengths, base = [], [], 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        nh, nw = -(-gh // window), -(-gw // window)
        idx = torch.full((t, nh * window, nw * window), -1, dtype=torch.int64)
        idx[:, :gh, :gw] = torch.arange(t * gh * gw).view(t, gh, gw) + base
        idx = idx.view(t, nh, window, nw, window).permute(0, 1, 3, 2, 4).reshape(t * nh * nw, window * window)
        counts = (idx >= 0).sum(1)  # [windows]
        order.append(idx[idx >= 0])
        lengths += (counts[counts > 0] * merge**2).tolist()
        base += t * gh * gw
    return torch.cat(order), lengths


class GatedVisionMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with biases."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        if act != "silu":
            raise ValueError(f"vision_config.hidden_act {act!r} is not supported (silu)")
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2_5_VLVisionTransformer(Qwen2VLVisionTransformer):
    def __init__(self, vc: dict) -> None:
        nn.Module.__init__(self)
        dim, hidden, act = vc.get("hidden_size", 1280), vc.get("intermediate_size", 3420), vc.get("hidden_act", "silu")
        self.build(vc, dim, vc["out_hidden_size"], RMSNorm, lambda: GatedVisionMLP(dim, hidden, act))
        self.full_attention = set(vc.get("fullatt_block_indexes", (7, 15, 23, 31)))
        window = vc.get("window_size", 112) // self.merge // vc.get("patch_size", 14)
        if window < 1:
            raise ValueError(
                f"vision_config.window_size {vc.get('window_size')} must be at least patch_size * spatial_merge_size"
            )
        self.window = window

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        x, cos, sin = self.embed(patches, grids)
        order, windows = window_order(grids, self.merge, self.window)
        unit = self.merge**2
        # The patches (and their rotary angles) in window order, a merged group's patches together.
        patch_order = (order.to(x.device).unsqueeze(1) * unit + torch.arange(unit, device=x.device)).flatten()
        x, cos, sin = x[patch_order], cos[patch_order], sin[patch_order]
        images = [t * h * w for t, h, w in grids]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, images if i in self.full_attention else windows)
        return self.merger(x)[torch.argsort(order.to(x.device))]


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    vision_class = Qwen2_5_VLVisionTransformer
