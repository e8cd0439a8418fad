"""The LinearMethod of a quantized weight: the layer holds qweight, scales, mins (layouts.py)
and computes with csrc/quant_ops.cpp's quant_linear (any number of rows)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.models.cpu_ops import cpu_ops
from pagedllm.models.layers.linear_method import UnquantizedLinearMethod
from pagedllm.models.layers.quantization.layouts import dequantize_reference


class QuantizedLinearMethod(UnquantizedLinearMethod):
    """Loads the float weight as the checkpoint has it and quantizes it once after loading
    (`quantize`); subclasses whose checkpoint is already quantized override the loading."""

    def __init__(self) -> None:
        self.ops = cpu_ops()  # None where the extension is not built: torch's dequantize + F.linear

    def quantize(self, w: torch.Tensor):
        """float w [N, K] -> (qweight, scales, mins) in a layout of layouts.py."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer):
        set_quantized(layer, *self.quantize(layer.weight.detach()))

    def apply(self, layer, x, bias=None):
        if self.ops is None:
            return F.linear(x, dequantize_reference(layer.qweight, layer.scales, layer.mins), bias)
        return self.ops.quant_linear(x, layer.qweight, layer.scales, layer.mins, bias)


def set_quantized(layer: torch.nn.Module, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> None:
    """Hold the quantized weight instead of the float one (a tied LM head only lets go of the
    embedding's weight, which the embedding keeps)."""
    layer.register_buffer("qweight", qweight.contiguous(), persistent=False)
    layer.register_buffer("scales", scales.float().contiguous(), persistent=False)
    layer.register_buffer("mins", mins.float().contiguous(), persistent=False)
    layer.weight = None
