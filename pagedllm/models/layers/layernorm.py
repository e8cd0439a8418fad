"""RMSNorm (transformers' arithmetic: normalise in float32, then scale), optionally with the
residual add before it (vLLM's fused_add_rms_norm: one pass where a fused op is there), and
Gemma's (1 + weight) variant."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm.models.layers.fused import fused_layer_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.ops = fused_layer_ops()  # C++ (built on the CPU) or Triton (on a GPU); None: torch

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """x [..., dim] -> the normed x; with residual: (norm(x + residual), x + residual)."""
        if residual is not None:
            if hasattr(self.ops, "fused_add_rms_norm"):
                return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
            x = x + residual
            return self.forward(x), x
        if self.ops is not None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the checkpoint's weight is an offset from 1 (scale = 1 + weight), and
    the scaling happens in float32 before the cast back (transformers' Gemma3RMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """x [..., dim] -> the normed x; with residual: (norm(x + residual), x + residual)."""
        if residual is not None:
            x = x + residual
            return self.forward(x), x
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)
