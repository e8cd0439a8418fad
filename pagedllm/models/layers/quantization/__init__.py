"""Weight-only quantization on the CPU: one LinearMethod per format (vLLM's
model_executor/layers/quantization/).

- int8 (int8.py): int8 with a scale and an offset (256 codes over the range, held as mins) in groups of 32
  (default) / 64 / 128 input features, or per output channel (group size -1), made at load time.
- int4 (int4.py): groups of 32/64/128 input features, each with a scale and a min (w = q s + m,
  q in 0..15), made at load time.
- gguf (gguf.py): a GGUF file's Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K tensors
  held in their own blocks, 16 rows interleaved (gguf_method.py, gguf_repack.py).

The loader makes the model's config current while it builds the model
(`set_current_quant_config`); linear.py `default_linear_method` asks it for each layer's method.
The kernels are csrc/quant_ops.cpp and csrc/gguf_linear.cpp (float32 activations).
"""
from __future__ import annotations

import contextlib
from typing import Optional

QUANTIZATION_METHODS = ("int8", "int4", "gguf")
INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_INT4_GROUP_SIZE = 32
PER_CHANNEL = -1   # int8's group size for one scale a row (GPTQ's -1)
INT8_GROUP_SIZES = INT4_GROUP_SIZES + (PER_CHANNEL,)
# Groups of 32 (docs/design.md: symmetric per-channel scales agreed with float32 greedy on 57 %).
DEFAULT_INT8_GROUP_SIZE = 32

_current = None


@contextlib.contextmanager
def set_current_quant_config(config):
    """Layers built inside take their LinearMethod from `config` (None: unquantized)."""
    global _current
    old, _current = _current, config
    try:
        yield
    finally:
        _current = old


def current_quant_config():
    return _current


def validate_quantization(method: Optional[str], group_size: Optional[int], device: str, dtype: str) -> None:
    """ValueError naming the field for a bad --quantization / --quantization-group-size."""
    if method is None:
        if group_size is not None:
            raise ValueError("quantization_group_size needs quantization int4")
        return
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {method!r}")
    sizes = {"int4": INT4_GROUP_SIZES, "int8": INT8_GROUP_SIZES}.get(method, ())
    if group_size is not None and group_size not in sizes:
        raise ValueError(f"quantization_group_size applies to int4 (one of {INT4_GROUP_SIZES}) and int8 "
                         f"(one of {INT8_GROUP_SIZES}, -1: per output channel), got {group_size!r} "
                         f"with quantization {method!r}")
    if device != "cpu" or dtype != "float32":
        raise ValueError(f"quantization {method!r} runs on the CPU in float32 (device cpu, dtype float32 "
                         f"or auto), got device {device!r}, dtype {dtype!r}")


def get_quant_config(method: Optional[str], group_size: Optional[int] = None, model_dir: Optional[str] = None):
    """The config object of a method name (None -> None); gguf reads the file's tensor types."""
    if method is None:
        return None
    if method == "int8":
        from pagedllm.models.layers.quantization.int8 import Int8Config
        return Int8Config(group_size or DEFAULT_INT8_GROUP_SIZE)
    if method == "int4":
        from pagedllm.models.layers.quantization.int4 import Int4Config
        return Int4Config(group_size or DEFAULT_INT4_GROUP_SIZE)
    from pagedllm.models.layers.quantization.gguf import GGUFConfig
    return GGUFConfig.from_model_dir(model_dir)
