"""`{arch}.*` metadata -> the HF config.json (a dict) of the registered architecture that runs
the file, with the values llama.cpp assumes where the file is silent (its llama-model.cpp)."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from pagedllm.models.gguf.metadata import ArchMetadata

# general.architecture -> (HF architecture, model_type). llama.cpp writes Mistral and Mixtral
# checkpoints as "llama" (Mixtral: expert_count > 0); "mistral" is transformers' own name.
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
MIXTRAL = ("MixtralForCausalLM", "mixtral")
DEFAULT_THETA = {"gemma3": 1_000_000.0}
GEMMA3_SLIDING_PATTERN = 6  # llama.cpp: every 6th layer global
GEMMA3_LOCAL_THETA = 10_000.0  # llama.cpp's rope_freq_base_train_swa for Gemma 3
GEMMA3_27B_LAYERS = 62  # its attention scale is hidden / heads, not head_dim


def check_architecture(arch: Optional[str], where: str) -> None:
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF file {where}: architecture {arch!r} is not supported; supported: "
            f"{', '.join(ARCHITECTURES)} (Mistral and Mixtral are written as 'llama')"
        )


def hf_config_from_gguf(
    meta: dict[str, Any], shapes: dict[str, tuple], where: str, rope_freqs: Optional[np.ndarray] = None
) -> dict:
    """meta (metadata.read_metadata), shapes {tensor name: numpy shape (rows first)}; rope_freqs:
    the `rope_freqs.weight` tensor (llama.cpp's Llama 3 RoPE scaling) where the file has one."""
    arch = meta.get("general.architecture")
    check_architecture(arch, where)
    a = ArchMetadata(meta, arch, where)
    experts = a.get("expert_count", 0) or 0
    architecture, model_type = MIXTRAL if arch == "llama" and experts else ARCHITECTURES[arch]
    hidden, heads = a.require("embedding_length"), a.require("attention.head_count")
    head_dim = a.get("attention.key_length") or a.get("rope.dimension_count") or hidden // heads
    cfg = {
        "architectures": [architecture],
        "model_type": model_type,
        "torch_dtype": "float32",
        "hidden_size": hidden,
        "num_hidden_layers": a.require("block_count"),
        "intermediate_size": a.require("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": a.get("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": a.require("context_length"),
        "rms_norm_eps": a.get("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": a.get("rope.freq_base", DEFAULT_THETA.get(arch, 10_000.0)),
        # The embedding's rows, not the token list: the model's shape is what the weights say.
        "vocab_size": shapes["token_embd.weight"][0],
        "tie_word_embeddings": "output.weight" not in shapes,
        "hidden_act": "silu",
    }
    for key, name in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("padding_token_id", "pad_token_id"),
    ):
        if f"tokenizer.ggml.{key}" in meta:
            cfg[name] = meta[f"tokenizer.ggml.{key}"]
    scaling = _rope_scaling(a, rope_freqs, head_dim)
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    if model_type == "mixtral":
        cfg.update(num_local_experts=experts, num_experts_per_tok=a.require("expert_used_count"))
    elif model_type == "qwen3_moe":
        cfg.update(
            num_experts=experts,
            num_experts_per_tok=a.require("expert_used_count"),
            moe_intermediate_size=a.require("expert_feed_forward_length"),
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    elif model_type == "qwen2":
        cfg["use_sliding_window"] = False
    elif model_type == "gemma3_text":
        n = cfg["num_hidden_layers"]
        cfg.update(
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=a.get("attention.sliding_window"),
            layer_types=[
                "sliding_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN else "full_attention" for i in range(n)
            ],
            rope_local_base_freq=GEMMA3_LOCAL_THETA,
            final_logit_softcapping=None,
            query_pre_attn_scalar=hidden // heads if n == GEMMA3_27B_LAYERS else head_dim,
        )
        cfg.pop("hidden_act")
    return cfg


def _rope_scaling(a: ArchMetadata, rope_freqs: Optional[np.ndarray], head_dim: int) -> Optional[dict]:
    kind = a.get("rope.scaling.type")
    if rope_freqs is not None:
        return llama3_scaling_from_factors(
            np.asarray(rope_freqs, np.float64), a.get("rope.freq_base", 10_000.0), head_dim, a.where
        )
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(
            f"GGUF file {a.where}: {a.arch}.rope.scaling.type {kind!r} is not supported (none, linear, yarn)"
        )
    scaling = {"rope_type": kind, "factor": float(a.require("rope.scaling.factor"))}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = a.require("rope.scaling.original_context_length")
    return scaling


def llama3_scaling_from_factors(factors: np.ndarray, theta: float, head_dim: int, where: str) -> dict:
    """The llama3 rope_scaling whose per-frequency divisors are `factors` [head_dim/2] (what
    convert_hf_to_gguf writes as rope_freqs.weight): 1 for short wavelengths, `factor` for long
    ones, and between them 1/f = (1 - s)/factor + s with s = (L/wavelength - low) / (high - low).
    s is linear in 1/wavelength, which fixes L/low and L/high; low = 1 as in every Llama 3."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    factor = float(factors.max())
    mid = (factors > 1 + 1e-6) & (factors < factor - 1e-6)
    if factor <= 1 or mid.sum() < 2:
        raise ValueError(
            f"GGUF file {where}: rope_freqs.weight has too few smoothed frequencies "
            f"({int(mid.sum())}) to recover its llama3 RoPE scaling"
        )
    s = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(inv_freq[mid] / (2 * np.pi), s, 1)  # s = L/(h-l) / wl - l/(h-l)
    high = 1 - 1 / intercept
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": float(np.round(high, 4)),
        "original_max_position_embeddings": int(np.round(slope * (high - 1))),
    }
