"""llama.cpp tensor names -> HF checkpoint names, per architecture, and what llama.cpp's
converter (convert_hf_to_gguf.py) did to a tensor that the loader must undo:
- Llama (and Mistral, Mixtral, written as "llama"): the rows of Q and K permuted per head so
  that each head's rotary halves interleave (LlamaModel.permute);
- Gemma 3: every RMSNorm weight stored as 1 + w (the engine's GemmaRMSNorm scales by 1 + w);
- MoE: each layer's experts stacked into one tensor [E, N, K] (ffn_gate_exps ...), split here
  into the per-expert names the MoE layers load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
SKIPPED = ("rope_freqs.weight",)  # read into the config (Llama 3 RoPE scaling)
ATTENTION = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
DENSE_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
LLAMA_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
GEMMA3_NORMS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# {e}: the expert index.
MIXTRAL_MOE = {
    "ffn_gate_inp": "block_sparse_moe.gate",
    "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
    "ffn_down_exps": "block_sparse_moe.experts.{e}.w2",
    "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
}
QWEN_MOE = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
}
LAYER_NAMES = {  # HF model_type -> blk.{i}.<key> -> model.layers.{i}.<name>
    "llama": {**LLAMA_NORMS, **ATTENTION, **DENSE_MLP},
    "mistral": {**LLAMA_NORMS, **ATTENTION, **DENSE_MLP},
    "qwen2": {**LLAMA_NORMS, **ATTENTION, **DENSE_MLP},
    "qwen3": {**LLAMA_NORMS, **ATTENTION, **QK_NORM, **DENSE_MLP},
    "mixtral": {**LLAMA_NORMS, **ATTENTION, **MIXTRAL_MOE},
    "qwen3_moe": {**LLAMA_NORMS, **ATTENTION, **QK_NORM, **QWEN_MOE},
    "gemma3_text": {**GEMMA3_NORMS, **ATTENTION, **QK_NORM, **DENSE_MLP},
}
PERMUTED_QK = ("llama", "mistral", "mixtral")
NORM_PLUS_ONE = ("gemma3_text",)
# Weights the engine holds in a quantized linear (GGUFLinearMethod): the dense layers' matrices.
QUANTIZED_LINEARS = frozenset(ATTENTION) | frozenset(DENSE_MLP)


@dataclass(frozen=True)
class Target:
    """Where one GGUF tensor goes: name (with {e} for stacked experts), heads (undo llama.cpp's
    Q/K row permutation over that many heads), norm_shift (subtract from the stored values),
    quantized (loaded into a quantized linear as the file's blocks)."""

    name: str
    heads: Optional[int] = None
    norm_shift: float = 0.0
    quantized: bool = False

    @property
    def experts(self) -> bool:
        return "{e}" in self.name


class TensorMap:
    """The GGUF -> HF names of one model (hf: its config.json, as hf_config.py writes it)."""

    def __init__(self, hf: dict) -> None:
        self.model_type = hf["model_type"]
        self.layers = LAYER_NAMES[self.model_type]
        self.heads = {"attn_q": hf["num_attention_heads"], "attn_k": hf["num_key_value_heads"]}

    def target(self, gguf_name: str) -> Optional[Target]:
        """The Target of a tensor, None for one the loader skips; ValueError for an unknown one."""
        if gguf_name in SKIPPED:
            return None
        parts = gguf_name.split(".")
        if len(parts) == 2 and parts[0] in TOP:
            return Target(f"{TOP[parts[0]]}.{parts[1]}", norm_shift=self._shift(parts[0]))
        if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in self.layers:
            _, index, key, suffix = parts
            heads = self.heads.get(key) if self.model_type in PERMUTED_QK else None
            return Target(
                f"model.layers.{index}.{self.layers[key]}.{suffix}",
                heads,
                self._shift(key),
                quantized=key in QUANTIZED_LINEARS and suffix == "weight",
            )
        raise ValueError(f"GGUF tensor {gguf_name!r} is not one of a {self.model_type} model's")

    def _shift(self, key: str) -> float:
        return 1.0 if self.model_type in NORM_PLUS_ONE and key.endswith("norm") else 0.0
