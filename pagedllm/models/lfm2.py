"""LFM2 (transformers' Lfm2ForCausalLM): a hybrid of gated short convolutions
(models/layers/mamba/short_conv.py) and a few full-attention layers, as the config's
`layer_types` ("conv" / "full_attention") says. The KV cache holds both: an attention group and
state groups over the same blocks (worker/state_cache.py).

The Llama skeleton (models/llama.py) with LFM2's differences: a conv layer's operator is the
short conv instead of attention; attention norms q and k per head (qk_norm) and calls its output
projection out_proj; the SwiGLU MLP (w1, w3, w2) has its width adjusted from the config
(`block_auto_adjust_ff_dim`); the final norm is named embedding_norm. One rank only."""

from __future__ import annotations

from torch import nn

from pagedllm.distributed.sharding import TPShard
from pagedllm.models.layers.layernorm import RMSNorm
from pagedllm.models.layers.mamba.short_conv import ShortConv
from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from pagedllm.models.mamba2 import refuse_parallel


def lfm2_intermediate_size(hf: dict) -> int:
    """The MLP's width as transformers' Lfm2MLP computes it."""
    size = hf["intermediate_size"]
    if hf.get("block_auto_adjust_ff_dim", True):
        size = int(2 * size / 3)
        multiplier = hf.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            size = int(multiplier * size)
            m = hf.get("block_multiple_of", 256)
            size = m * ((size + m - 1) // m)
    return size


class Lfm2DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm layer whose operator is the short conv (module `conv`) or attention."""

    def __init__(self, hf: dict, tp: TPShard, head_dim: int, comm=None, layer_idx: int = 0) -> None:
        nn.Module.__init__(self)
        hidden, eps = hf["hidden_size"], hf["rms_norm_eps"]
        self.input_layernorm = RMSNorm(hidden, eps)
        self.is_attention = hf["layer_types"][layer_idx] != "conv"
        if self.is_attention:
            self.self_attn = LlamaAttention(hf, tp, head_dim, comm, qk_norm=True)
        else:
            self.conv = ShortConv(hidden, hf.get("conv_L_cache", 3), hf.get("conv_bias", False))
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = LlamaMLP(hidden, tp.intermediate, False, comm)

    def forward(self, x, positions, rope, residual=None):
        x, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
        operator = self.self_attn if self.is_attention else self.conv
        x, residual = self.post_attention_layernorm(operator(x, positions, rope), residual)
        return self.mlp(x), residual


class Lfm2ForCausalLM(LlamaForCausalLM):
    decoder_layer = Lfm2DecoderLayer

    def __init__(self, hf: dict, max_positions: int, parallel=None) -> None:
        refuse_parallel(parallel, "LFM2")
        types = hf.get("layer_types") or [
            "full_attention" if i in (hf.get("full_attn_idxs") or ()) else "conv"
            for i in range(hf["num_hidden_layers"])
        ]
        hf = {
            "tie_word_embeddings": True,
            **hf,
            "layer_types": types,
            "rms_norm_eps": hf.get("norm_eps", 1e-5),
            "intermediate_size": lfm2_intermediate_size(hf),
        }
        super().__init__(hf, max_positions, parallel)

    def weight_name_mapping(self):
        return [
            (".self_attn.o_proj", ".self_attn.out_proj", None),
            (".self_attn.q_norm", ".self_attn.q_layernorm", None),
            (".self_attn.k_norm", ".self_attn.k_layernorm", None),
            (".conv.conv_weight", ".conv.conv.weight", None),
            (".conv.conv_bias", ".conv.conv.bias", None),
            (".input_layernorm", ".operator_norm", None),
            (".post_attention_layernorm", ".ffn_norm", None),
            (".mlp.gate_up_proj", ".feed_forward.w1", 0),
            (".mlp.gate_up_proj", ".feed_forward.w3", 1),
            (".mlp.down_proj", ".feed_forward.w2", None),
            ("norm.", "embedding_norm.", None),
        ] + super().weight_name_mapping()
