"""--quantization int4: groups of 32/64/128 input features with a scale and a min each (w = q s +
m, q 0..15), made at load time from the float weights. The LM head is int8 in groups of 32 (as
llama.cpp keeps its output tensor at 6-8 bits: it decides every token)."""

from __future__ import annotations

from pagedllm.models.layers.quantization.base import QuantizedLinearMethod
from pagedllm.models.layers.quantization.int8 import LM_HEAD_GROUP, Int8LinearMethod
from pagedllm.models.layers.quantization.layouts import quantize_int4


class Int4LinearMethod(QuantizedLinearMethod):
    def __init__(self, group_size: int) -> None:
        super().__init__()
        self.group_size = group_size

    def create_weights(self, layer, input_size, output_size):
        if input_size % self.group_size:
            raise ValueError(
                f"quantization_group_size {self.group_size} does not divide a layer's "
                f"input size {input_size}; pick one that does (32, 64 or 128)"
            )
        super().create_weights(layer, input_size, output_size)

    def quantize(self, w):
        return quantize_int4(w, self.group_size)


class Int4Config:
    name = "int4"

    @classmethod
    def from_quant_args(cls, group_size: int, model_dir, hf_config) -> "Int4Config":
        return cls(group_size)

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def get_linear_method(self, lm_head: bool = False):
        return Int8LinearMethod(LM_HEAD_GROUP, offset=False) if lm_head else Int4LinearMethod(self.group_size)
