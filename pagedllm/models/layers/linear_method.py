"""How a linear layer computes: the slot where quantized weights and adapters plug in.

A LinearMethod creates the layer's weight (`create_weights`), turns the loaded checkpoint
weight into what it computes with (`process_weights_after_loading`, once) and computes
(`apply`). The layer owns which slice of the checkpoint it holds (models/layers/linear.py); the
method owns the arithmetic. One is chosen when the layer is built (linear.py
`default_linear_method`), from the device and dtype the model is built in (the loader sets both
as torch's defaults) and the environment.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


def base_method(linear: nn.Module) -> "LinearMethodBase":
    """The layer's own method: a LoRA method wraps it (lora/layers.py) over the same weights."""
    return getattr(linear.linear_method, "base_method", linear.linear_method)


class LinearMethodBase:
    # The row count from which `apply` runs a kernel the CPU decode loop does not call
    # (models/cpu_decode_loop.py): a step of that many rows takes the eager path, so that the
    # loop stays bit for bit the eager layers. None: the loop computes every row count as apply.
    eager_from_rows: Optional[int] = None

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        """Register `layer.weight` [output_size, input_size] (this rank's sizes)."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once after every weight is loaded (repack, quantize, ...)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [T, input_size] -> [T, output_size]."""
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethodBase):
    """The weight as the checkpoint has it; F.linear."""

    def create_weights(self, layer, input_size, output_size):
        layer.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)

    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.weight, bias)
