"""Architecture name (config.json "architectures") -> model class."""
from __future__ import annotations

from pagedllm.models.llama import LlamaForCausalLM

_MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def get_model_class(hf_config: dict):
    for arch in hf_config.get("architectures") or []:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(f"architecture {hf_config.get('architectures')} is not supported; "
                     f"supported: {', '.join(_MODELS)}")
