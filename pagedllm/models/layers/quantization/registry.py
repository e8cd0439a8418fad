"""Quantization methods by name: the one table that the CLI's --quantization choices, the
benches, config validation, the model resolver and the loader read. A method is one class (its
config: which LinearMethod each layer gets) and one line in METHODS; the class is imported when
a model is loaded (the kernels import torch), so this module stays torch-free for the CLI and
the model config's loader (models/model_config_loader.py).

The class's protocol: `from_quant_args(group_size, model_dir, hf_config)` -> an instance
(group_size: one of the line's group_sizes or None) whose `get_linear_method(lm_head)` gives
each linear's LinearMethod; optionally `get_embedding_method()`, `iter_weights(model_dir)`
(the checkpoint's tensors, when they are not safetensors) and `process_weights(weights, model,
device, dtype)` (the checkpoint's stream, changed as it goes past).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Optional

INT4_GROUP_SIZES = (32, 64, 128)
PER_CHANNEL = -1  # int8's group size for one scale a row (GPTQ's -1)
# Groups of 32 first, the default (docs/design.md: symmetric per-channel scales agreed with
# float32 greedy on 57 %).
INT8_GROUP_SIZES = INT4_GROUP_SIZES + (PER_CHANNEL,)


@dataclass(frozen=True)
class QuantizationMethod:
    config_class: str  # "module:Class"
    group_sizes: tuple[int, ...] = ()  # --quantization-group-size values, the default first; (): none
    # Chosen by config.json's quantization_config.quant_method (the checkpoint is stored so),
    # not by --quantization; it applies with any --quantization.
    from_checkpoint: bool = False
    # The ready models (download.py) are served from their own file of this method.
    ready_files: bool = False


_PKG = "pagedllm.models.layers.quantization"
METHODS: dict[str, QuantizationMethod] = {
    "int8": QuantizationMethod(f"{_PKG}.int8:Int8Config", INT8_GROUP_SIZES),
    "int4": QuantizationMethod(f"{_PKG}.int4:Int4Config", INT4_GROUP_SIZES),
    "gguf": QuantizationMethod(f"{_PKG}.gguf:GGUFConfig", ready_files=True),
    "fp8": QuantizationMethod(f"{_PKG}.fp8:Fp8Config", from_checkpoint=True),
}


def quantization_choices() -> list[str]:
    """The --quantization values (the methods a float checkpoint can be served in)."""
    return [name for name, m in METHODS.items() if not m.from_checkpoint]


def validate_quantization(method: Optional[str], group_size: Optional[int], device: str, dtype: str) -> None:
    """ValueError naming the field for a bad --quantization / --quantization-group-size."""
    if method is None:
        if group_size is not None:
            raise ValueError("quantization_group_size needs quantization int4")
        return
    choices = quantization_choices()
    if method not in choices:
        raise ValueError(f"quantization must be one of {', '.join(choices)}, got {method!r}")
    if group_size is not None and group_size not in METHODS[method].group_sizes:
        raise ValueError(
            f"quantization_group_size applies to int4 (one of {INT4_GROUP_SIZES}) and int8 "
            f"(one of {INT8_GROUP_SIZES}, -1: per output channel), got {group_size!r} "
            f"with quantization {method!r}"
        )
    if device != "cpu" or dtype != "float32":
        raise ValueError(
            f"quantization {method!r} runs on the CPU in float32 (device cpu, dtype float32 "
            f"or auto), got device {device!r}, dtype {dtype!r}"
        )


def takes_group_size(method: Optional[str]) -> bool:
    return method is not None and bool(METHODS[method].group_sizes)


def method_class(name: str) -> type:
    module, cls = METHODS[name].config_class.split(":")
    return getattr(importlib.import_module(module), cls)


def get_quant_config(
    method: Optional[str],
    group_size: Optional[int] = None,
    model_dir: Optional[str] = None,
    hf_config: Optional[dict] = None,
):
    """The config object of --quantization `method` (None -> None)."""
    if method is None:
        return None
    sizes = METHODS[method].group_sizes
    return method_class(method).from_quant_args(group_size or (sizes[0] if sizes else None), model_dir, hf_config)


def checkpoint_quant_config(hf_config: dict, model_dir: Optional[str] = None):
    """The config object of the checkpoint's own quantization (config.json quantization_config,
    e.g. DeepSeek's FP8 blocks), or None: a float checkpoint, or a quant_method not registered."""
    name = (hf_config.get("quantization_config") or {}).get("quant_method")
    if name not in METHODS or not METHODS[name].from_checkpoint:
        return None
    return method_class(name).from_quant_args(None, model_dir, hf_config)
