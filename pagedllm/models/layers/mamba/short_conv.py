"""LFM2's gated short convolution (transformers' Lfm2ShortConv): in_proj to (B, C, x), then
C * conv(B * x) with a causal depthwise conv of kernel L_cache that continues from each
request's conv state (its last L_cache - 1 inputs), then out_proj. Its state is that conv
state alone."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.models.layers.linear import ReplicatedLinear
from pagedllm.models.layers.mamba.causal_conv1d import causal_conv1d
from pagedllm.models.layers.mamba.state_layer import StateLayer


class ShortConv(StateLayer):
    def __init__(self, hidden: int, kernel: int, bias: bool) -> None:
        super().__init__()
        self.hidden = hidden
        self.in_proj = ReplicatedLinear(hidden, 3 * hidden, bias)
        self.conv_weight = nn.Parameter(torch.empty(hidden, 1, kernel), requires_grad=False)
        self.conv_bias = nn.Parameter(torch.empty(hidden), requires_grad=False) if bias else None
        self.out_proj = ReplicatedLinear(hidden, hidden, bias)
        self.state_shapes = ((hidden, kernel - 1),)

    def forward(self, x: torch.Tensor, positions=None, rope=None) -> torch.Tensor:
        """x [T, hidden] (requests packed) -> [T, hidden]; positions and rope unused (the
        attention layers' signature)."""
        meta = self.step_state()
        B, C, xs = self.in_proj(x).chunk(3, dim=-1)  # [T, hidden] each
        conv = self.load_state(meta, 0)  # [R, hidden, K-1] (a copy)
        y = causal_conv1d(B * xs, self.conv_weight[:, 0], self.conv_bias, conv, meta.query_start_loc)
        self.store_state(meta, 0, conv)
        return self.out_proj(C * y)
