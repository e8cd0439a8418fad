"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen 3 attention (q/k norm) and a sparse MoE block
(`mlp.gate` + `mlp.experts.{e}.gate_proj/up_proj/down_proj`, `moe_intermediate_size`) in the
layers that have one: layer i is sparse unless listed in `mlp_only_layers`, and only when
(i + 1) is a multiple of `decoder_sparse_step`; the others keep a dense MLP of
`intermediate_size`. Softmax top-k routing, renormalised when `norm_topk_prob`.
"""

from __future__ import annotations

from pagedllm.models.layers.fused_moe import FusedMoE
from pagedllm.models.mixtral import MoEBlock, num_experts_of
from pagedllm.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM


def is_sparse_layer(hf: dict, layer_idx: int) -> bool:
    """transformers' rule (num_experts 0: every layer dense)."""
    step = hf.get("decoder_sparse_step", 1) or 1
    has_experts = bool(hf.get("num_local_experts") or hf.get("num_experts"))
    return has_experts and layer_idx not in (hf.get("mlp_only_layers") or []) and (layer_idx + 1) % step == 0


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, hf, tp, comm, layer_idx):
        if not is_sparse_layer(hf, layer_idx):
            return super().make_mlp(hf, tp, comm, layer_idx)
        return MoEBlock(hf, tp, comm, hf["moe_intermediate_size"], bool(hf.get("norm_topk_prob", False)))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    decoder_layer = Qwen3MoeDecoderLayer

    def weight_name_mapping(self):
        if not any(is_sparse_layer(self.hf, i) for i in range(self.hf["num_hidden_layers"])):
            return super().weight_name_mapping()
        experts = FusedMoE.make_expert_params_mapping(num_experts_of(self.hf))
        return [(f".mlp{ours}", f".mlp{ckpt}", sid) for ours, ckpt, sid in experts] + super().weight_name_mapping()
