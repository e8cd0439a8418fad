"""--quantization int8: int8 with a scale and an offset (256 codes over the group's range, the
offset held as int4's mins) in groups of 32 input features by default, 64, 128, or one a row
(per output channel, group size -1), made at load time from the float weights. The LM head of every quantized model
is symmetric int8 (no offset) in groups of 32, as GGUF's Q8_0."""

from __future__ import annotations

from typing import Optional

import torch

from pagedllm.models.layers.quantization.base import QuantizedLinearMethod
from pagedllm.models.layers.quantization.layouts import quantize_int8, quantize_int8_offset


# The LM head (every token's choice between near-equal logits) in groups of 32, as GGUF's Q8_0
# output tensors: a Q8_0 embedding re-quantized this way is its own values again.
LM_HEAD_GROUP = 32


class Int8LinearMethod(QuantizedLinearMethod):
    """group_size None: one group a row (per output channel). offset: w = q s + m over the
    group's [min, max] (layouts.quantize_int8_offset; else symmetric, w = q s)."""

    def __init__(self, group_size: Optional[int] = None, offset: bool = True) -> None:
        super().__init__()
        self.group_size, self.offset = group_size, offset

    def quantize(self, w):
        g = self.group_size or w.shape[1]
        if w.shape[1] % g:
            g = w.shape[1]  # a row that is not whole groups: one scale a row
        if self.offset:
            return quantize_int8_offset(w, g)
        q, s = quantize_int8(w, g)
        return q, s, torch.empty(0)


class Int8Config:
    name = "int8"

    @classmethod
    def from_quant_args(cls, group_size: int, model_dir, hf_config) -> "Int8Config":
        return cls(group_size)

    def __init__(self, group_size: int) -> None:
        self.group_size = None if group_size == -1 else group_size  # -1: per output channel

    def get_linear_method(self, lm_head: bool = False):
        if lm_head:
            return Int8LinearMethod(LM_HEAD_GROUP, offset=False)
        return Int8LinearMethod(self.group_size)
