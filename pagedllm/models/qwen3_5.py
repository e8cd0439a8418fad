"""Qwen3.5's text model (transformers' Qwen3_5ForCausalLM, config `qwen3_5_text`): Qwen3-Next's
layer set (models/qwen3_next.py: Gated DeltaNet and gated attention layers by `layer_types`,
zero-centred RMSNorms, partial rotary) with a dense MLP in every layer and the Gated DeltaNet's
projections as separate matrices (models/layers/mamba/gated_deltanet.FlatGatedDeltaNet). Its
multimodal RoPE sections coincide with plain RoPE for text (the three position axes are equal).
One rank only."""

from __future__ import annotations

from pagedllm.models.layers.mamba.gated_deltanet import FlatGatedDeltaNet
from pagedllm.models.qwen3_next import Qwen3NextDecoderLayer, Qwen3NextForCausalLM


class Qwen3_5DecoderLayer(Qwen3NextDecoderLayer):
    deltanet = FlatGatedDeltaNet


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    decoder_layer = Qwen3_5DecoderLayer

    def weight_name_mapping(self):
        return [
            (".linear_attn.in_proj.", f".linear_attn.in_proj_{part}.", i)
            for i, part in enumerate(("qkv", "z", "b", "a"))
        ] + super().weight_name_mapping()
