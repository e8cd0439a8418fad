"""Granite-4.0-H (transformers' GraniteMoeHybridForCausalLM): Mamba2 layers
(models/layers/mamba/mamba_mixer2.py, their states in the attention layers' blocks) with a few
attention layers, as the config's `layer_types` says ("linear_attention" / "full_attention").

The Llama skeleton (models/llama.py) with Granite's differences: every layer has a shared
SwiGLU MLP (`shared_mlp`, its gate and up fused in one `input_linear`) plus, where
`num_local_experts` > 0, a routed MoE (softmax over the top-k router logits; models/mixtral.py's
MoEBlock); each branch's output is scaled by `residual_multiplier` before its residual add, the
embedding by `embedding_multiplier`, the logits divided by `logits_scaling`; attention scales by
`attention_multiplier` and rotates only with `position_embedding_type` "rope". One rank only."""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from pagedllm.distributed.sharding import TPShard
from pagedllm.models.layers.fused_moe import FusedMoE
from pagedllm.models.layers.layernorm import RMSNorm
from pagedllm.models.layers.mamba.mamba_mixer2 import Mamba2Mixer
from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from pagedllm.models.mamba2 import refuse_parallel
from pagedllm.models.mixtral import MoEBlock


def mamba_config(hf: dict) -> dict:
    """The Mamba2 mixer's config names from Granite's."""
    return {
        "hidden_size": hf["hidden_size"],
        "num_heads": hf["mamba_n_heads"],
        "head_dim": hf["mamba_d_head"],
        "expand": hf.get("mamba_expand", 2),
        "n_groups": hf.get("mamba_n_groups", 1),
        "state_size": hf.get("mamba_d_state", 256),
        "conv_kernel": hf.get("mamba_d_conv", 4),
        "chunk_size": hf.get("mamba_chunk_size", 256),
        "layer_norm_epsilon": hf.get("rms_norm_eps", 1e-6),
        "time_step_limit": hf.get("time_step_limit") or (0.0, float("inf")),
        "hidden_act": hf.get("hidden_act", "silu"),
        "use_bias": hf.get("mamba_proj_bias", False),
        "use_conv_bias": hf.get("mamba_conv_bias", True),
    }


class NoRope(nn.Module):
    """position_embedding_type None: q and k as they are."""

    def forward(self, positions, q, k):
        return q, k


class GraniteMoeHybridDecoderLayer(LlamaDecoderLayer):
    def __init__(self, hf: dict, tp: TPShard, head_dim: int, comm=None, layer_idx: int = 0) -> None:
        nn.Module.__init__(self)
        hidden, eps = hf["hidden_size"], hf.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.is_attention = hf["layer_types"][layer_idx] not in ("linear_attention", "mamba")
        if self.is_attention:
            self.self_attn = LlamaAttention(hf, tp, head_dim, comm)
            self.self_attn.scale = self.self_attn.attn.scale = hf.get("attention_multiplier", 1.0)
        else:
            self.mamba = Mamba2Mixer(mamba_config(hf))
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.block_sparse_moe = (
            MoEBlock(hf, tp, comm, hf["intermediate_size"], renormalize=True)
            if hf.get("num_local_experts", 0) > 0
            else None
        )
        self.shared_mlp = LlamaMLP(hidden, range(hf["shared_intermediate_size"]), False, comm)
        self.residual_multiplier = hf.get("residual_multiplier", 1.0)

    def forward(self, x, positions, rope, residual=None):
        x, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope) if self.is_attention else self.mamba(x)
        x, residual = self.post_attention_layernorm(x * self.residual_multiplier, residual)
        out = self.shared_mlp(x)
        if self.block_sparse_moe is not None:
            out = self.block_sparse_moe(x) + out
        return out * self.residual_multiplier, residual


class GraniteMoeHybridForCausalLM(LlamaForCausalLM):
    decoder_layer = GraniteMoeHybridDecoderLayer

    def __init__(self, hf: dict, max_positions: int, parallel=None) -> None:
        refuse_parallel(parallel, "GraniteMoeHybrid")
        hf = {**hf, "layer_types": hf.get("layer_types") or hf.get("layers_block_type")}
        super().__init__(hf, max_positions, parallel)
        self.embedding_multiplier = hf.get("embedding_multiplier", 1.0)
        self.logits_scaling = hf.get("logits_scaling", 1.0)

    def make_rope(self, hf, head_dim, max_positions):
        return (
            super().make_rope(hf, head_dim, max_positions) if hf.get("position_embedding_type") == "rope" else NoRope()
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        return self.lm_head(hidden) / self.logits_scaling

    def weight_name_mapping(self):
        n = self.hf.get("num_local_experts", 0)
        experts = FusedMoE.make_expert_params_mapping(n) if n > 0 else []
        return (
            [(f".block_sparse_moe{ours}", f".block_sparse_moe{ckpt}", sid) for ours, ckpt, sid in experts]
            + [
                (".mamba.conv1d_weight", ".mamba.conv1d.weight", None),
                (".mamba.conv1d_bias", ".mamba.conv1d.bias", None),
                (".mamba.norm_weight", ".mamba.norm.weight", None),
            ]
            + super().weight_name_mapping()
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(split_fused(weights))


def split_fused(weights: Iterable[tuple[str, torch.Tensor]]):
    """Granite's fused checkpoint matrices as one matrix each, the names the Llama / Mixtral
    mappings know: shared_mlp.input_linear [2S, H] -> gate_proj, up_proj; the experts'
    input_linear [E, 2I, H] -> experts.e.gate_proj / up_proj, output_linear [E, H, I] ->
    experts.e.down_proj (under either of transformers' names); the router -> gate."""
    for name, w in weights:
        prefix, _, rest = name.rpartition(".block_sparse_moe.")
        if rest in ("input_linear.weight", "experts.gate_up_proj"):
            for e, gate_up in enumerate(w):
                gate, up = gate_up.chunk(2)
                yield f"{prefix}.block_sparse_moe.experts.{e}.gate_proj.weight", gate
                yield f"{prefix}.block_sparse_moe.experts.{e}.up_proj.weight", up
        elif rest in ("output_linear.weight", "experts.down_proj"):
            for e, down in enumerate(w):
                yield f"{prefix}.block_sparse_moe.experts.{e}.down_proj.weight", down
        elif rest in ("router.layer.weight", "router.weight"):
            yield f"{prefix}.block_sparse_moe.gate.weight", w
        elif name.endswith(".shared_mlp.input_linear.weight"):
            gate, up = w.chunk(2)
            base = name.removesuffix("input_linear.weight")
            yield base + "gate_proj.weight", gate
            yield base + "up_proj.weight", up
        elif name.endswith(".shared_mlp.output_linear.weight"):
            yield name.replace("output_linear", "down_proj"), w
        else:
            yield name, w
