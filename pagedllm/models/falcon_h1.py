"""Falcon-H1 (transformers' FalconH1ForCausalLM): every layer runs attention and a Mamba2 mixer
side by side on the same normed input and adds both to the residual stream, then a SwiGLU MLP.
The Llama skeleton (models/llama.py) with models/layers/mamba/mamba_mixer2.py's mixer (its
states in the attention layers' blocks, several blocks where a state is larger than a page).

muP multipliers: the embedding, the LM head's logits, each branch's input and output (ssm_in /
ssm_out, attention_in / attention_out) are scaled where they are used; the ones inside a
projection are folded into its weights as they load: key_multiplier into k_proj, the MLP's
gate and down multipliers into gate_proj and down_proj, and the mixer's per-section `ssm_multipliers`
(z, x, B, C, dt of in_proj's output: transformers' mup_vector) into in_proj's rows. The mixer's
intermediate size is `mamba_d_ssm` where set; its gated RMSNorm is optional
(`mamba_rms_norm`) and normalises before or after the gate (`mamba_norm_before_gate`)."""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from pagedllm.distributed.sharding import TPShard
from pagedllm.models.layers.layernorm import RMSNorm
from pagedllm.models.layers.mamba.mamba_mixer2 import GATE_ONLY, GATE_THEN_NORM, NORM_THEN_GATE, Mamba2Mixer
from pagedllm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from pagedllm.models.mamba2 import refuse_parallel


def mixer_config(hf: dict) -> dict:
    """The Mamba2 mixer's config names from Falcon-H1's."""
    order = (
        GATE_ONLY
        if not hf.get("mamba_rms_norm", False)
        else NORM_THEN_GATE
        if hf.get("mamba_norm_before_gate", True)
        else GATE_THEN_NORM
    )
    return {
        "hidden_size": hf["hidden_size"],
        "num_heads": hf["mamba_n_heads"],
        "head_dim": hf["mamba_d_head"],
        "expand": hf.get("mamba_expand", 2),
        "d_ssm": hf.get("mamba_d_ssm"),
        "n_groups": hf.get("mamba_n_groups", 1),
        "state_size": hf.get("mamba_d_state", 256),
        "conv_kernel": hf.get("mamba_d_conv", 4),
        "chunk_size": hf.get("mamba_chunk_size", 256),
        "layer_norm_epsilon": hf.get("rms_norm_eps", 1e-5),
        "time_step_limit": hf.get("time_step_limit") or (0.0, float("inf")),
        "hidden_act": hf.get("hidden_act", "silu"),
        "use_bias": hf.get("mamba_proj_bias", False),
        "out_bias": hf.get("projectors_bias", False),
        "use_conv_bias": hf.get("mamba_conv_bias", True),
        "norm_order": order,
    }


def mup_vector(hf: dict, mixer: Mamba2Mixer) -> torch.Tensor:
    """The scale of each of in_proj's output rows: z [I], x [I], B [G N], C [G N], dt [H]."""
    sizes = [
        mixer.intermediate,
        mixer.intermediate,
        mixer.n_groups * mixer.d_state,
        mixer.n_groups * mixer.d_state,
        mixer.num_heads,
    ]
    mults = hf.get("ssm_multipliers") or [1.0] * 5
    return torch.cat([torch.full((n,), float(m)) for n, m in zip(sizes, mults)])


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, hf: dict, tp: TPShard, head_dim: int, comm=None, layer_idx: int = 0) -> None:
        super().__init__()
        hidden, eps = hf["hidden_size"], hf.get("rms_norm_eps", 1e-5)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = LlamaAttention(hf, tp, head_dim, comm)
        self.mamba = Mamba2Mixer(mixer_config(hf))
        self.pre_ff_layernorm = RMSNorm(hidden, eps)
        self.feed_forward = LlamaMLP(hidden, tp.intermediate, hf.get("mlp_bias", False), comm)
        self.ssm_in, self.ssm_out = hf.get("ssm_in_multiplier", 1.0), hf.get("ssm_out_multiplier", 1.0)
        self.attn_in = hf.get("attention_in_multiplier", 1.0)
        self.attn_out = hf.get("attention_out_multiplier", 1.0)

    def forward(self, x, positions, rope, residual=None):
        x, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
        both = (
            self.mamba(x * self.ssm_in) * self.ssm_out
            + self.self_attn(x * self.attn_in, positions, rope) * self.attn_out
        )
        x, residual = self.pre_ff_layernorm(both, residual)
        return self.feed_forward(x), residual


class FalconH1ForCausalLM(LlamaForCausalLM):
    decoder_layer = FalconH1DecoderLayer

    def __init__(self, hf: dict, max_positions: int, parallel=None) -> None:
        refuse_parallel(parallel, "FalconH1")
        super().__init__(hf, max_positions, parallel)
        self.embedding_multiplier = hf.get("embedding_multiplier", 1.0)
        self.lm_head_multiplier = hf.get("lm_head_multiplier", 1.0)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        return self.lm_head(hidden) * self.lm_head_multiplier

    def weight_name_mapping(self):
        return [
            (".mamba.conv1d_weight", ".mamba.conv1d.weight", None),
            (".mamba.conv1d_bias", ".mamba.conv1d.bias", None),
            (".mamba.norm_weight", ".mamba.norm.weight", None),
            ("norm.weight", "final_layernorm.weight", None),
        ] + super().weight_name_mapping()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self.fold_multipliers(weights))

    def fold_multipliers(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """The multipliers inside a projection, folded into its weights (and biases)."""
        hf = self.hf
        gate_m, down_m = hf.get("mlp_multipliers") or (1.0, 1.0)
        scales = {
            ".self_attn.k_proj.": hf.get("key_multiplier", 1.0),
            ".feed_forward.gate_proj.": gate_m,
            ".feed_forward.down_proj.": down_m,
        }
        mup = mup_vector(hf, next(m for m in self.modules() if isinstance(m, Mamba2Mixer)))
        for name, w in weights:
            if ".mamba.in_proj." in name:  # rows of the weight [rows, hidden], or the bias [rows]
                w = w * mup.to(w.dtype).view(-1, *([1] * (w.dim() - 1)))
            else:
                w = w * next((s for part, s in scales.items() if part in name), 1.0)
            yield name, w
