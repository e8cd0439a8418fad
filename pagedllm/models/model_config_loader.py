"""A model directory -> its ModelConfig: config.json read, a vision-language config flattened to
its text model, the architecture checked against the registry, the quantization a directory
implies (a GGUF directory is served as "gguf"). The engine's EngineArgs builds the ModelConfig
here (vLLM's ModelConfig is built from the HF config the same way), so that config.py holds
plain values and imports no subsystem. Torch-free."""

from __future__ import annotations

import json
import os
from typing import Optional

from pagedllm.config import DTYPES, ModelConfig
from pagedllm.models.hf_config import flatten_multimodal_config
from pagedllm.models.layers.quantization.gguf_dir import is_gguf_dir
from pagedllm.models.layers.quantization.registry import validate_quantization
from pagedllm.models.registry import resolve_architecture


def model_config_from_dir(
    path: str, dtype: str = "float32", max_model_len: Optional[int] = None, seed: int = 0
) -> ModelConfig:
    """The ModelConfig of an HF-format model directory; max_model_len None: the model's
    max_position_embeddings (2048 where config.json has none)."""
    if not os.path.isdir(path):
        raise ValueError(f"model path '{path}' does not exist or is not a directory")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"model directory '{path}' has no config.json; an HF-format model directory is required")
    with open(cfg_path) as f:
        hf = flatten_multimodal_config(json.load(f))
    resolve_architecture(hf, where=f" in '{cfg_path}'")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    derived = int(hf.get("max_position_embeddings", 2048))
    if max_model_len is None:
        max_model_len = derived
    elif not isinstance(max_model_len, int) or not (1 <= max_model_len <= derived):
        raise ValueError(
            f"max_model_len must be an integer in [1, {derived}] "
            f"(the model's max_position_embeddings), got {max_model_len!r}"
        )
    return ModelConfig(model=path, hf_config=hf, dtype=dtype, max_model_len=max_model_len, seed=seed)


def set_quantization(config: ModelConfig, method: Optional[str], group_size: Optional[int], device: str) -> None:
    """--quantization validated against the registry (models/layers/quantization/registry.py)
    for the config's (resolved) dtype; a GGUF model directory (quantization/gguf.py) is always
    served as "gguf"."""
    if is_gguf_dir(config.model):
        if method not in (None, "gguf"):
            raise ValueError(f"quantization {method!r}: a GGUF model is served as it is (quantization gguf)")
        method = "gguf"
    validate_quantization(method, group_size, device, config.dtype)
    config.quantization, config.quantization_group_size = method, group_size
