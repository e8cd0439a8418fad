"""SiLU-and-multiply: x [T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.models.layers.fused import fused_layer_ops


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ops = fused_layer_ops()   # one pass in C++ (built on the CPU) or Triton (on a GPU); None: torch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.silu_and_mul(x)
        gate, up = x.split(x.shape[-1] // 2, dim=-1)
        return F.silu(gate) * up
