"""Mixtral (`MixtralForCausalLM`): Llama attention, and in every layer a sparse MoE block
(`block_sparse_moe`: a router `gate` [E, H] and experts w1 / w3 / w2 = gate / up / down) in
place of the MLP; softmax top-k routing, always renormalised.

`MoEBlock` (router + FusedMoE) is also Qwen3-MoE's block (qwen3_moe.py). The checkpoint's
`block_sparse_moe.` is our `mlp.`, so the decoder layer is Llama's.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed.sharding import TPShard
from pagedllm.models.layers.fused_moe import FusedMoE, expert_intermediate_range
from pagedllm.models.layers.linear import ReplicatedLinear
from pagedllm.models.layers.linear_method import UnquantizedLinearMethod
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM


def num_experts_of(hf: dict) -> int:
    # transformers 5 writes num_local_experts for Qwen3-MoE too; older configs say num_experts.
    n = hf.get("num_local_experts") or hf.get("num_experts")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"the config's num_local_experts / num_experts must be an integer >= 1, got {n!r}")
    return n


class MoEBlock(nn.Module):
    """Router (replicated on every rank) + routed experts: x [T, H] -> [T, H]."""

    def __init__(self, hf: dict, tp: TPShard, comm, intermediate_size: int, renormalize: bool) -> None:
        super().__init__()
        num_experts, hidden = num_experts_of(hf), hf["hidden_size"]
        # The router stays in float under weight quantization (as vLLM's; GGUF files keep it F32).
        self.gate = ReplicatedLinear(hidden, num_experts, bias=False, linear_method=UnquantizedLinearMethod())
        self.experts = FusedMoE(
            num_experts,
            hf["num_experts_per_tok"],
            hidden,
            expert_intermediate_range(intermediate_size, tp),
            comm,
            renormalize,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))  # router logits [T, E]


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, hf, tp, comm, layer_idx):
        return MoEBlock(hf, tp, comm, hf["intermediate_size"], renormalize=True)


class MixtralForCausalLM(LlamaForCausalLM):
    decoder_layer = MixtralDecoderLayer

    def weight_name_mapping(self):
        experts = FusedMoE.make_expert_params_mapping(num_experts_of(self.hf), "w1", "w2", "w3")
        return (
            [(f".mlp{ours}", f".block_sparse_moe{ckpt}", sid) for ours, ckpt, sid in experts]
            + [(".mlp.gate.", ".block_sparse_moe.gate.", None)]
            + super().weight_name_mapping()
        )
