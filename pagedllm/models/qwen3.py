"""Qwen 3 (`Qwen3ForCausalLM`): the Llama layers with an RMSNorm over each head's q and k
before RoPE, no q/k/v bias (unless the config sets `attention_bias`), head_dim from the
config. Everything else (parallelism, weight loading, the paged KV cache) is LlamaForCausalLM's.
"""

from __future__ import annotations

from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Qwen3DecoderLayer(LlamaDecoderLayer):
    qk_norm = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer = Qwen3DecoderLayer
