"""Gated activations: x [T, 2I] (gate | up) -> act(gate) * up [T, I]: SiLU (Llama), GELU (Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.models.layers.fused import fused_layer_ops


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ops = fused_layer_ops()  # one pass in C++ (built on the CPU) or Triton (on a GPU); None: torch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.silu_and_mul(x)
        gate, up = x.split(x.shape[-1] // 2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """GELU-and-multiply (GeGLU, Gemma's MLP): x [T, 2I] (gate | up) -> gelu(gate) * up [T, I];
    approximate "tanh" is transformers' `gelu_pytorch_tanh`."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.split(x.shape[-1] // 2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up
