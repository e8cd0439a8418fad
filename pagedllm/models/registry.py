"""Architecture name (config.json "architectures") -> model class.

The classes are imported when first asked for, so that reading a model directory
(model_config_loader.py) imports no torch. A new architecture is one line here and its module under pagedllm/models/.
"""

from __future__ import annotations

import importlib

# architecture -> (module under pagedllm.models, class name)
_MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("gemma3_mm", "Gemma3ForConditionalGeneration"),
    "Idefics3ForConditionalGeneration": ("idefics3", "Idefics3ForConditionalGeneration"),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Mamba2ForCausalLM": ("mamba2", "Mamba2ForCausalLM"),
    "Lfm2ForCausalLM": ("lfm2", "Lfm2ForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("granitemoehybrid", "GraniteMoeHybridForCausalLM"),
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("qwen3_5", "Qwen3_5ForCausalLM"),
    "FalconH1ForCausalLM": ("falcon_h1", "FalconH1ForCausalLM"),
}
SUPPORTED_ARCHITECTURES = tuple(_MODELS)


def resolve_architecture(hf_config: dict, where: str = "") -> str:
    """The first of the config's architectures that pagedllm runs; ValueError otherwise."""
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in _MODELS:
            return arch
    raise ValueError(f"architecture {archs}{where} is not supported; supported: {', '.join(_MODELS)}")


def get_model_class(hf_config: dict):
    module, name = _MODELS[resolve_architecture(hf_config)]
    return getattr(importlib.import_module(f"pagedllm.models.{module}"), name)
