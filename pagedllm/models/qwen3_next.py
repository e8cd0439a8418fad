"""Qwen3-Next (transformers' Qwen3NextForCausalLM): Gated DeltaNet layers
(models/layers/mamba/gated_deltanet.py, their states in the attention layers' blocks) with a few
full-attention layers, as the config's `layer_types` says ("linear_attention" /
"full_attention").

The Llama skeleton (models/llama.py) with Qwen3-Next's differences: every RMSNorm scales by
(1 + weight) (zero-centred weights, as Gemma's); attention norms q and k per head, rotates only
the first `partial_rotary_factor` of each head, and gates its output: q_proj gives each head's
query and a gate, the output is attn * sigmoid(gate) before o_proj; the MLP of a sparse layer is
the routed experts (softmax top-k, renormalised when `norm_topk_prob`) plus a shared expert
scaled by sigmoid(shared_expert_gate(x)). One rank only."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed.sharding import TPShard
from pagedllm.models.layers.fused_moe import FusedMoE
from pagedllm.models.layers.layernorm import GemmaRMSNorm
from pagedllm.models.layers.linear import QKVParallelLinear, ReplicatedLinear
from pagedllm.models.layers.mamba.gated_deltanet import GatedDeltaNet
from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from pagedllm.models.mamba2 import refuse_parallel
from pagedllm.models.mixtral import MoEBlock, num_experts_of
from pagedllm.models.qwen3_moe import is_sparse_layer

LAYER_TYPES = ("linear_attention", "full_attention")


class Qwen3NextAttention(LlamaAttention):
    """Attention with a sigmoid output gate: q_proj holds 2 x head_dim rows a head (its query,
    then its gate), loaded as twice as many query heads of the fused qkv_proj."""

    def __init__(self, hf: dict, tp: TPShard, head_dim: int, comm=None) -> None:
        super().__init__(hf, tp, head_dim, comm)
        q_and_gate = range(2 * tp.q_heads.start, 2 * tp.q_heads.stop)
        self.qkv_proj = QKVParallelLinear(
            hf["hidden_size"], head_dim, q_and_gate, tp.kv_heads, hf.get("attention_bias", False)
        )
        eps = hf.get("rms_norm_eps", 1e-6)
        self.q_norm, self.k_norm = GemmaRMSNorm(head_dim, eps), GemmaRMSNorm(head_dim, eps)

    def forward(self, x, positions, rope):
        T, H, D = x.shape[0], self.num_heads, self.head_dim
        qg, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = qg.view(T, H, 2 * D).chunk(2, dim=-1)  # [T, H, D] each
        q = self.q_norm(q).contiguous()
        k = self.k_norm(k.view(T, self.num_kv_heads, D)).contiguous()
        q, k = rope(positions, q, k)
        o = self.attn(q, k, v.reshape(T, self.num_kv_heads, D))
        return self.o_proj(o.reshape(T, self.q_size) * torch.sigmoid(gate.reshape(T, self.q_size)))


class Qwen3NextSparseMoe(MoEBlock):
    """Routed experts plus a shared expert gated per token by sigmoid(shared_expert_gate(x))."""

    def __init__(self, hf: dict, tp: TPShard, comm=None) -> None:
        super().__init__(hf, tp, comm, hf["moe_intermediate_size"], bool(hf.get("norm_topk_prob", True)))
        hidden = hf["hidden_size"]
        self.shared_expert = LlamaMLP(hidden, range(hf["shared_expert_intermediate_size"]), False, comm)
        self.shared_expert_gate = ReplicatedLinear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen3NextDecoderLayer(LlamaDecoderLayer):
    deltanet = GatedDeltaNet  # the linear-attention layers' class (Qwen3.5: FlatGatedDeltaNet)

    def __init__(self, hf: dict, tp: TPShard, head_dim: int, comm=None, layer_idx: int = 0) -> None:
        nn.Module.__init__(self)
        hidden, eps = hf["hidden_size"], hf.get("rms_norm_eps", 1e-6)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.is_attention = hf["layer_types"][layer_idx] == "full_attention"
        if self.is_attention:
            self.self_attn = Qwen3NextAttention(hf, tp, head_dim, comm)
        else:
            self.linear_attn = self.deltanet(hf)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = (
            Qwen3NextSparseMoe(hf, tp, comm)
            if is_sparse_layer(hf, layer_idx)
            else LlamaMLP(hidden, tp.intermediate, False, comm)
        )

    def forward(self, x, positions, rope, residual=None):
        x, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope) if self.is_attention else self.linear_attn(x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen3NextForCausalLM(LlamaForCausalLM):
    decoder_layer = Qwen3NextDecoderLayer

    def __init__(self, hf: dict, max_positions: int, parallel=None) -> None:
        refuse_parallel(parallel, "Qwen3-Next")
        types = list(hf.get("layer_types") or [])
        if len(types) != hf["num_hidden_layers"] or not set(types) <= set(LAYER_TYPES):
            raise ValueError(
                f"layer_types must list one of {LAYER_TYPES} for each of the "
                f"{hf['num_hidden_layers']} layers, got {types!r}"
            )
        rope = hf.get("rope_parameters") or {}
        hf = {**hf, "partial_rotary_factor": hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))}
        super().__init__(hf, max_positions, parallel)

    def make_norm(self, hidden: int, eps: float) -> nn.Module:
        return GemmaRMSNorm(hidden, eps)

    def weight_name_mapping(self):
        sparse = any(is_sparse_layer(self.hf, i) for i in range(self.hf["num_hidden_layers"]))
        experts = FusedMoE.make_expert_params_mapping(num_experts_of(self.hf)) if sparse else []
        return (
            [(f".mlp{ours}", f".mlp{ckpt}", sid) for ours, ckpt, sid in experts]
            + [
                (".linear_attn.conv1d_weight", ".linear_attn.conv1d.weight", None),
                (".linear_attn.norm_weight", ".linear_attn.norm.weight", None),
            ]
            + super().weight_name_mapping()
        )
