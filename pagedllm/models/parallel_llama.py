"""One rank's part of a Llama-family model under tensor and pipeline parallelism.

Built from the same decoder layers as models/llama.py with local sizes (this rank's query /
KV heads and intermediate slice), the output and down projections swapped for row-parallel
ones, and only the layers of this rank's pipeline stage. See distributed/sharding.py for who
holds what; shard_weight() cuts each checkpoint tensor to this rank's slice as it is loaded.
"""
from __future__ import annotations

import re
from typing import Optional

import torch
from torch import nn

from pagedllm.distributed.parallel_state import ParallelContext
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, RMSNorm, RotaryEmbedding
from pagedllm.models.parallel_layers import (ParallelLMHead, PPMissingLayer, RowParallelLinear,
                                             VocabParallelEmbedding)

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")


class ParallelLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, hf: dict, max_positions: int, parallel: ParallelContext) -> None:
        nn.Module.__init__(self)
        self.hf = hf
        self.parallel = parallel
        shard = self.shard = parallel.shard
        tp, comm = shard.tp, parallel.tp
        hidden, head_dim = hf["hidden_size"], shard.head_dim
        eps = hf.get("rms_norm_eps", 1e-6)
        first, last = shard.is_first_stage, shard.is_last_stage
        # The embedding and the LM head live on stage 0 (the driver samples there).
        self.embed_tokens = VocabParallelEmbedding(tp.vocab, hidden, comm) if first else None
        layers = []
        for i in range(hf["num_hidden_layers"]):
            if i not in shard.layers:
                layers.append(PPMissingLayer())
                continue
            layer = LlamaDecoderLayer(hf, len(tp.q_heads), len(tp.kv_heads), head_dim)
            attn = layer.self_attn
            attn.o_proj = RowParallelLinear(attn.q_size, hidden, hf.get("attention_bias", False), comm)
            layer.mlp = LlamaMLP(hidden, len(tp.intermediate), hf.get("mlp_bias", False))
            layer.mlp.down_proj = RowParallelLinear(len(tp.intermediate), hidden,
                                                    hf.get("mlp_bias", False), comm)
            layers.append(layer)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden, eps) if last else None
        self.tie_word_embeddings = bool(hf.get("tie_word_embeddings", False)) and first
        self.lm_head = ParallelLMHead(tp.vocab, hidden, hf["vocab_size"], comm) if first else None
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(hf, head_dim, max_positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_in: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Stage 0 embeds input_ids; a later stage starts from hidden_in (the previous stage's
        output). The last stage applies the norm."""
        x = self.embed_tokens(input_ids) if hidden_in is None else hidden_in
        for layer in self.layers[self.shard.layers.start:self.shard.layers.stop]:
            x = layer(x, positions, self.rope)
        return self.norm(x) if self.norm is not None else x

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """Stage 0 only: logits [B, vocab] on TP rank 0, None on the other TP ranks."""
        return self.lm_head(hidden)

    def shard_weight(self, target: str, part: Optional[int], tensor: torch.Tensor) -> Optional[torch.Tensor]:
        """This rank's slice of a checkpoint tensor (named as in our module, `part` = index inside
        a fused QKV / gate-up parameter), or None when another rank holds it."""
        shard, tp = self.shard, self.shard.tp
        d = shard.head_dim
        m = _LAYER.match(target)
        if m is None:
            if target in ("embed_tokens.weight", "lm_head.weight"):
                return tensor[tp.vocab.start:tp.vocab.stop] if shard.is_first_stage else None
            if target == "norm.weight":
                return tensor if shard.is_last_stage else None
            return tensor
        idx, mod, kind = int(m.group(1)), m.group(2), m.group(3)
        if idx not in shard.layers:
            return None
        if mod == "self_attn.qkv_proj":
            heads = tp.q_heads if part == 0 else tp.kv_heads
            return tensor[heads.start * d:heads.stop * d]
        if mod == "mlp.gate_up_proj":
            return tensor[tp.intermediate.start:tp.intermediate.stop]
        if mod == "self_attn.o_proj" and kind == "weight":
            return tensor[:, tp.q_heads.start * d:tp.q_heads.stop * d]
        if mod == "mlp.down_proj" and kind == "weight":
            return tensor[:, tp.intermediate.start:tp.intermediate.stop]
        return tensor   # norms, row-parallel biases: whole
