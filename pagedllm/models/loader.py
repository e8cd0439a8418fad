"""Load an HF-format directory (safetensors) into the model of its architecture: one loop,
model-agnostic. The model is built on its device in its dtype (torch's defaults while it is
built, so that each layer picks its LinearMethod and fused ops then); its `load_weights` maps
the checkpoint's names onto its parameters, whose weight loaders cut this rank's slices; then
each linear method prepares its weights (e.g. packs them for oneDNN)."""

from __future__ import annotations

import contextlib
import glob
import os

import torch
from safetensors import safe_open

from pagedllm.attention.selector import get_attn_backend, set_current_attn_backend
from pagedllm.config import ModelConfig
from pagedllm.models.layers.quantization import set_current_quant_config
from pagedllm.models.layers.quantization.registry import checkpoint_quant_config, get_quant_config
from pagedllm.models.layers.linear_method import base_method
from pagedllm.models.layers.weight_copies import choose_weight_copies
from pagedllm.models.registry import get_model_class


def _dtype(config: ModelConfig) -> torch.dtype:
    if config.dtype == "auto":
        return torch.float32  # EngineArgs resolves "auto"; a direct caller gets the CPU's default
    return getattr(torch, config.dtype)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def iter_weights(model_dir: str):
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"model directory '{model_dir}' has no *.safetensors weights")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(model: torch.nn.Module, weights, source: str) -> None:
    """model.load_weights(weights), then every parameter must have been loaded; ValueError
    naming the tensors otherwise. Then each layer's linear method prepares its weights."""
    with torch.no_grad():
        try:
            loaded = model.load_weights(weights)
        except ValueError as e:
            raise ValueError(f"{e} in {source}") from e
    missing = sorted(name for name, _ in model.named_parameters() if name not in loaded)
    if missing:
        raise ValueError(f"weights missing from {source}: {missing[:5]}")
    layers = [m for m in model.modules() if getattr(m, "linear_method", None) is not None]
    choose_weight_copies([(m, base_method(m)) for m in layers])
    for module in layers:
        module.linear_method.process_weights_after_loading(module)


def load_model(
    config: ModelConfig, parallel=None, device: str = "cpu", attention_backend: str = "torch", model_cls=None
) -> torch.nn.Module:
    """parallel (pagedllm.distributed.parallel_state.ParallelContext): load only this rank's
    shard (tensor / pipeline parallelism); None: the whole model. device: where the weights
    live ("cpu" or "cuda"); attention_backend: "torch" or "triton", resolved once by
    attention/selector.py for the model's Attention layers. model_cls: another model of the
    same checkpoint (the MTP module, models/deepseek_mtp.py) instead of its architecture's."""
    cls = model_cls or get_model_class(config.hf_config)
    dtype = _dtype(config)
    backend = get_attn_backend(device, dtype, attention_backend)
    quant = get_quant_config(config.quantization, config.quantization_group_size, config.model, config.hf_config)
    with (
        torch.device(device),
        _default_dtype(dtype),
        set_current_attn_backend(backend),
        set_current_quant_config(quant),
    ):
        model = cls(config.hf_config, config.max_model_len, parallel)
    weights = quant.iter_weights(config.model) if hasattr(quant, "iter_weights") else iter_weights(config.model)
    stored = checkpoint_quant_config(config.hf_config, config.model)
    if stored is not None:  # e.g. DeepSeek-style FP8 blocks: upcast as they stream past
        weights = stored.process_weights(weights, model, device, dtype)
    load_weights(model, weights, config.model)
    model = model.eval().requires_grad_(False)
    return model
