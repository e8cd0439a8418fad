"""An adapter directory in PEFT's LoRA format, checked against the base model before any
tensor is read: adapter_config.json + adapter_model.safetensors (never a pickle), targets among
q/k/v/o and gate/up/down of the decoder layers, a rank within --max-lora-rank. Every refusal is
a ValueError naming the file, module or option."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from safetensors import safe_open

from pagedllm.json_config import read_json_object

CONFIG_NAME, WEIGHTS_NAME = "adapter_config.json", "adapter_model.safetensors"

# PEFT's projection name -> (our fused layer under layers.{i}, the shard index inside it).
TARGETS = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}

# PEFT's key: base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight
_KEY = re.compile(r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")

# Options that change what the adapter computes and that we do not implement: (key, why).
_REFUSED = (
    ("use_dora", "DoRA (use_dora) is not supported"),
    ("modules_to_save", "modules_to_save (fully trained modules) is not supported"),
    ("fan_in_fan_out", "fan_in_fan_out is not supported (Llama's projections are nn.Linear)"),
    ("rank_pattern", "per-module ranks (rank_pattern) are not supported"),
    ("alpha_pattern", "per-module alphas (alpha_pattern) are not supported"),
    ("layers_to_transform", "layers_to_transform is not supported"),
    ("lora_bias", "LoRA biases (lora_bias) are not supported"),
)


def projection_shapes(hf: dict) -> dict[str, tuple[int, int]]:
    """PEFT projection -> (out_features, in_features) of the whole (unsharded) base matrix."""
    H = hf["hidden_size"]
    D = hf.get("head_dim") or H // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"] * D, hf.get("num_key_value_heads", hf["num_attention_heads"]) * D
    inter = hf.get("intermediate_size")
    return {
        "q_proj": (q, H),
        "k_proj": (kv, H),
        "v_proj": (kv, H),
        "o_proj": (H, q),
        "gate_proj": (inter, H),
        "up_proj": (inter, H),
        "down_proj": (H, inter),
    }


@dataclass
class PEFTHelper:
    """What an adapter directory holds, checked: its rank, scaling, and per (layer, projection)
    the safetensors keys of A and B."""

    path: str
    r: int
    scaling: float  # lora_alpha / r, or / sqrt(r) with rsLoRA
    keys: dict[tuple[int, str], tuple[str, str]]  # (layer, PEFT projection) -> (A key, B key)

    @classmethod
    def from_local_dir(cls, path: str, hf: dict, max_lora_rank: int) -> "PEFTHelper":
        cfg = _read_config(path)
        for key, why in _REFUSED:
            if cfg.get(key):
                raise ValueError(f"adapter {path}: {why} ({key}={cfg[key]!r})")
        if cfg.get("bias", "none") != "none":
            raise ValueError(f"adapter {path}: bias={cfg['bias']!r} is not supported (only 'none')")
        r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise ValueError(f"adapter {path}: r must be an integer >= 1, got {r!r}")
        if r > max_lora_rank:
            raise ValueError(f"adapter {path}: rank r={r} is more than max_lora_rank ({max_lora_rank})")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            raise ValueError(f"adapter {path}: lora_alpha must be a number, got {alpha!r}")
        scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        keys = _check_tensors(path, hf, r)
        return cls(path, r, scaling, keys)


def _read_config(path: str) -> dict:
    if not isinstance(path, str) or not os.path.isdir(path):
        raise ValueError(f"adapter path {path!r} is not a directory")
    cfg_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(cfg_path):
        raise ValueError(f"adapter {path}: no {CONFIG_NAME}")
    if not os.path.isfile(os.path.join(path, WEIGHTS_NAME)):
        found = [f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth"))]
        extra = f" (found {found}: pickled weights are never loaded)" if found else ""
        raise ValueError(f"adapter {path}: no {WEIGHTS_NAME}{extra}")
    cfg = read_json_object(cfg_path, f"adapter {path}: {CONFIG_NAME}")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {path}: peft_type {cfg.get('peft_type')!r} is not supported (only LORA)")
    return cfg


def _check_tensors(path: str, hf: dict, r: int) -> dict[tuple[int, str], tuple[str, str]]:
    """Every tensor is an A or B of a supported projection of an existing layer, shaped
    [r, in] / [out, r]; each A has its B."""
    shapes, num_layers = projection_shapes(hf), hf["num_hidden_layers"]
    found: dict[tuple[int, str], dict[str, str]] = {}
    try:
        f = safe_open(os.path.join(path, WEIGHTS_NAME), framework="pt")
    except Exception as e:  # safetensors raises its own error types for a bad header
        raise ValueError(f"adapter {path}: {WEIGHTS_NAME} is not a readable safetensors file: {e}") from None
    with f:
        for key in f.keys():
            m = _KEY.match(key)
            if m is None:
                raise ValueError(
                    f"adapter {path}: tensor {key!r} is not a LoRA A/B of a decoder layer's "
                    f"projection (supported modules: {sorted(TARGETS)})"
                )
            layer, proj, ab = int(m.group(1)), m.group(2), m.group(3)
            if proj not in TARGETS:
                raise ValueError(
                    f"adapter {path}: target module {proj!r} is not supported (supported: {sorted(TARGETS)})"
                )
            if layer >= num_layers:
                raise ValueError(f"adapter {path}: {key!r} names layer {layer}; the model has {num_layers}")
            out, inp = shapes[proj]
            want = (r, inp) if ab == "A" else (out, r)
            got = tuple(f.get_slice(key).get_shape())
            if got != want:
                raise ValueError(
                    f"adapter {path}: {key!r} has shape {list(got)}, the model needs {list(want)} "
                    "(an adapter of another base model?)"
                )
            found.setdefault((layer, proj), {})[ab] = key
    for (layer, proj), ab in found.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"adapter {path}: layer {layer} {proj} has lora_{set(ab).pop()} without its pair")
    if not found:
        raise ValueError(f"adapter {path}: {WEIGHTS_NAME} holds no LoRA weights")
    return {k: (v["A"], v["B"]) for k, v in found.items()}


def check_lora_request(lora, config, known: dict) -> None:
    """A request's LoRARequest against the engine (ValueError): LoRA on, the adapter directory
    valid for the model (read once per id: `known` maps checked ids to their request), one id
    for one adapter."""
    from pagedllm.lora.request import LoRARequest

    if not isinstance(lora, LoRARequest):
        raise ValueError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
    lc = config.lora_config
    if lc is None:
        raise ValueError(
            f"lora_request {lora.lora_name!r} given, but LoRA is off: "
            "start the engine with enable_lora=True (--enable-lora)"
        )
    seen = known.get(lora.lora_int_id)
    if seen is not None:
        if seen.lora_path != lora.lora_path:
            raise ValueError(
                f"lora_int_id {lora.lora_int_id} is already adapter {seen.lora_path!r}; "
                f"give {lora.lora_path!r} an id of its own"
            )
        return
    PEFTHelper.from_local_dir(lora.lora_path, config.model_config.hf_config, lc.max_lora_rank)
    known[lora.lora_int_id] = lora
