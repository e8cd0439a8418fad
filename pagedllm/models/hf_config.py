"""Shapes read from a config.json (a dict), by the rules transformers applies; torch-free, so
that the config, the sharding plan, the models and the benchmarks all read them one way."""

from __future__ import annotations


def head_dim_of(hf_config: dict) -> int:
    """config.json's head_dim, else hidden_size / num_attention_heads."""
    return hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]


def layer_types_of(hf_config: dict):
    """config.json's `layer_types` ("sliding_attention" / "full_attention" per layer), or Gemma
    3's default pattern (every `sliding_window_pattern`-th layer global) where it has none;
    None for a model without per-layer types."""
    types, n = hf_config.get("layer_types"), hf_config["num_hidden_layers"]
    if types is None and hf_config.get("model_type", "").startswith("gemma3"):
        pattern = hf_config.get("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    return types


def layer_sliding_windows(hf_config: dict) -> list:
    """Each layer's sliding window (an int), or None where the layer attends to everything, as
    transformers reads the config: the "sliding_attention" layers of `layer_types_of`, Qwen 2/3
    (and their MoE) only with `use_sliding_window`, and every layer of a Mistral with `sliding_window`."""
    n, window = hf_config["num_hidden_layers"], hf_config.get("sliding_window")
    if not window or (hf_config.get("model_type", "").startswith("qwen") and not hf_config.get("use_sliding_window")):
        return [None] * n
    types = layer_types_of(hf_config)
    if types is not None:
        return [window if t == "sliding_attention" else None for t in types]
    return [window] * n


def mixes_attention_windows(hf_config: dict) -> bool:
    """Whether the layers attend over different windows (Gemma 3's sliding and full layers), so
    that their KV cache keeps several groups (the layers declare them: core/kv_cache_utils.py);
    config validation refuses what reads one block table for such a model before it is built."""
    return len(set(layer_sliding_windows(hf_config))) > 1


# Layer types of recurrent layers in configs' `layer_types` (LFM2's "conv", Granite / Qwen3-Next's
# "mamba" / "linear_attention"), and model types whose every layer is recurrent (Falcon-H1's:
# attention and Mamba2 side by side).
RECURRENT_LAYER_TYPES = ("conv", "mamba", "linear_attention")
RECURRENT_MODEL_TYPES = ("mamba", "mamba2", "falcon_h1")


def has_recurrent_layers(hf_config: dict) -> bool:
    """Whether some layers keep a recurrent state (their KV cache has state groups), which
    config validation reads to refuse what needs a KV cache of attention layers only."""
    return hf_config.get("model_type") in RECURRENT_MODEL_TYPES or any(
        t in RECURRENT_LAYER_TYPES for t in hf_config.get("layer_types") or ()
    )


# Vision-language architectures whose text model is one of ours: the engine reads the text
# model's shapes (KV cache, vocabulary) at the top level, the whole config under "multimodal_config".
MULTIMODAL_ARCHITECTURES = (
    "Idefics3ForConditionalGeneration",
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Gemma3ForConditionalGeneration",
)
# Those whose image tokens attend to each other both ways (Gemma 3): an image is prefilled in one step.
BIDIRECTIONAL_IMAGE_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)


def bidirectional_image_tokens(hf_config: dict) -> int:
    """The tokens of one image where an image's tokens attend to each other both ways (they
    must be prefilled in one step), else 0. hf_config: flattened (flatten_multimodal_config)."""
    mm = hf_config.get("multimodal_config") or {}
    if not set(mm.get("architectures") or ()) & set(BIDIRECTIONAL_IMAGE_ARCHITECTURES):
        return 0
    return mm.get("mm_tokens_per_image", 256)


def flatten_multimodal_config(hf_config: dict) -> dict:
    """A vision-language config.json -> its text_config with "architectures" and the whole
    config ("multimodal_config") added; any other config unchanged. Qwen's own Qwen2-VL
    checkpoints keep the text model's fields at the top level (no text_config)."""
    if not set(hf_config.get("architectures") or ()) & set(MULTIMODAL_ARCHITECTURES):
        return hf_config
    text = dict(hf_config.get("text_config") or {k: v for k, v in hf_config.items() if k != "vision_config"})
    text["architectures"] = hf_config["architectures"]
    text["multimodal_config"] = hf_config
    return text
