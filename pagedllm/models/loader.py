"""Load an HF-format Llama-family directory (safetensors) into our module, fusing QKV and gate/up."""
from __future__ import annotations

import glob
import os
import re

import torch
from safetensors import safe_open

from pagedllm.attention.selector import get_attn_backend, set_current_attn_backend
from pagedllm.config import ModelConfig
from pagedllm.models.cpu_linear import pack_linears
from pagedllm.models.cpu_ops import enable_fused_cpu_ops
from pagedllm.models.registry import get_model_class

# HF name -> (our name, shard index within a fused parameter or None)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def _dtype(config: ModelConfig) -> torch.dtype:
    if config.dtype == "auto":
        return torch.float32  # EngineArgs resolves "auto"; a direct caller gets the CPU's default
    return getattr(torch, config.dtype)


def iter_weights(model_dir: str):
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"model directory '{model_dir}' has no *.safetensors weights")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(config: ModelConfig, parallel=None, device: str = "cpu",
               attention_backend: str = "torch") -> torch.nn.Module:
    """parallel (pagedllm.distributed.parallel_state.ParallelContext): load only this rank's
    shard (tensor / pipeline parallelism); None: the whole model. device: where the weights
    live ("cpu" or "cuda"); attention_backend: "torch" or "triton", resolved once by
    attention/selector.py for the model's Attention layers."""
    cls = get_model_class(config.hf_config)
    dtype = _dtype(config)
    backend = get_attn_backend(device, dtype, attention_backend)
    with torch.device("meta"), set_current_attn_backend(backend):
        if parallel is None:
            model = cls(config.hf_config, config.max_model_len)
        else:
            from pagedllm.models.parallel_llama import ParallelLlamaForCausalLM
            model = ParallelLlamaForCausalLM(config.hf_config, config.max_model_len, parallel)
    model = model.to_empty(device=device)
    # Buffers (RoPE tables) were made on meta: build them again for real (in float32 on the
    # CPU, as transformers does, then moved).
    model.rope.__init__(config.hf_config, config.head_dim, config.max_model_len)
    model.rope.to(device)
    params = dict(model.named_parameters())
    pending: dict[str, dict[int, torch.Tensor]] = {}
    loaded = set()
    for name, tensor in iter_weights(config.model):
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "lm_head.weight" and model.tie_word_embeddings:
            continue
        target, shard = _map_name(name)
        if parallel is not None:
            tensor = model.shard_weight(target, shard, tensor)
            if tensor is None:  # held by another rank
                continue
        if shard is None:
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} in {config.model}")
            params[target].data.copy_(tensor)
            loaded.add(target)
        else:
            parts = pending.setdefault(target, {})
            parts[shard] = tensor
            need = 3 if "qkv" in target else 2
            if len(parts) == need:
                params[target].data.copy_(torch.cat([parts[i] for i in range(need)], dim=0))
                loaded.add(target)
                del pending[target]
    missing = [n for n in params if n not in loaded and not (n == "lm_head.weight" and model.tie_word_embeddings)]
    if missing or pending:
        raise ValueError(f"weights missing from {config.model}: {sorted(missing or pending)[:5]}")
    if model.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model = model.to(dtype).eval().requires_grad_(False)
    if torch.device(device).type == "cpu":
        pack_linears(model)   # after the dtype cast: the packed copy is made in the final dtype
        enable_fused_cpu_ops(model)
    return model


def _map_name(name: str) -> tuple[str, int | None]:
    m = _LAYER.match(name)
    if m:
        idx, mod, kind = m.groups()
        if mod in _FUSED:
            fused, shard = _FUSED[mod]
            return f"layers.{idx}.{fused}.{kind}", shard
        return f"layers.{idx}.{mod}.{kind}", None
    if name.startswith("model."):
        return name[len("model."):], None
    return name, None
