"""Gemma 3, text only (Gemma3ForCausalLM; config model_type gemma3_text), over a paged KV cache.

The Llama family's skeleton (models/llama.py: the same fused QKV / gate-up linears, tensor and
pipeline parallel plan, weight names and loading) with Gemma's differences:
- interleaved local and global layers (config `layer_types`): the local ("sliding_attention")
  ones attend to the last `sliding_window` tokens and rotate with their own RoPE base
  (`rope_local_base_freq`, or `rope_parameters["sliding_attention"]`), the global ones with
  rope_theta and its scaling;
- RMSNorm scales by (1 + weight) in float32, and q and k are normed per head before RoPE;
- four norms a layer (before and after attention and the MLP), a GeGLU MLP (gelu tanh);
- the embedding is scaled by sqrt(hidden_size), attention by query_pre_attn_scalar ** -0.5;
- final logit soft-capping where the config has it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm.distributed.sharding import TPShard
from pagedllm.models.hf_config import layer_sliding_windows, layer_types_of
from pagedllm.models.layers.activation import GeluAndMul
from pagedllm.models.layers.layernorm import GemmaRMSNorm
from pagedllm.models.layers.rotary_embedding import RotaryEmbedding
from pagedllm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP

GLOBAL_DEFAULT_THETA, LOCAL_DEFAULT_THETA = 1_000_000.0, 10_000.0  # transformers' Gemma3TextConfig


def gemma3_rope_config(hf: dict, layer_type: str) -> dict:
    """The RoPE config of one layer type, in the shape rotary_embedding.rope_inv_freq reads:
    transformers 5 writes `rope_parameters` per layer type; older configs have rope_theta (+
    rope_scaling) for global layers and rope_local_base_freq for local ones."""
    params = hf.get("rope_parameters") or {}
    if layer_type in params:
        return {"rope_parameters": params[layer_type]}
    if layer_type == "sliding_attention":
        return {"rope_theta": hf.get("rope_local_base_freq", LOCAL_DEFAULT_THETA)}
    return {"rope_theta": hf.get("rope_theta", GLOBAL_DEFAULT_THETA), "rope_scaling": hf.get("rope_scaling")}


class Gemma3Attention(LlamaAttention):
    def __init__(self, hf: dict, tp: TPShard, head_dim: int, comm, sliding_window: Optional[int]) -> None:
        super().__init__(hf, tp, head_dim, comm, sliding_window=sliding_window)
        self.scale = self.attn.scale = hf["query_pre_attn_scalar"] ** -0.5
        self.q_norm = GemmaRMSNorm(head_dim, hf.get("rms_norm_eps", 1e-6))
        self.k_norm = GemmaRMSNorm(head_dim, hf.get("rms_norm_eps", 1e-6))

    def forward(self, x, positions, rope):
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(T, self.num_heads, self.head_dim))  # [T, H, D]
        k = self.k_norm(k.reshape(T, self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
        q, k = rope(positions, q, k)
        o = self.attn(q, k, v.reshape(T, self.num_kv_heads, self.head_dim))
        return self.o_proj(o.reshape(T, self.q_size))


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self, hf: dict, tp: TPShard, head_dim: int, comm, layer_type: str, sliding_window: Optional[int]
    ) -> None:
        super().__init__()
        hidden, eps = hf["hidden_size"], hf.get("rms_norm_eps", 1e-6)
        self.layer_type = layer_type
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = Gemma3Attention(hf, tp, head_dim, comm, sliding_window)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = LlamaMLP(hidden, tp.intermediate, False, comm)
        self.mlp.act_fn = GeluAndMul("tanh")  # hidden_activation gelu_pytorch_tanh
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, x, positions, rope: nn.ModuleDict, residual=None):
        """rope: the model's RoPE per layer type; this layer rotates with its own type's. The
        residual-stream protocol of LlamaForCausalLM.forward, with the stream kept whole (its
        norms come after the adds): -> (stream, None)."""
        if residual is not None:
            x = x + residual
        attn = self.self_attn(self.input_layernorm(x), positions, rope[self.layer_type])
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), None


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, hf: dict, max_positions: int, parallel=None) -> None:
        if hf.get("attn_logit_softcapping") is not None:
            raise ValueError(
                "attn_logit_softcapping (Gemma 2) is not supported: the attention "
                "backends compute softmax(q k^T) without a cap"
            )
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
        hf = {"tie_word_embeddings": True, "query_pre_attn_scalar": 256, **hf}  # the config's defaults
        self.layer_types = layer_types_of(hf)
        super().__init__(hf, max_positions, parallel)
        self.embed_scale = hf["hidden_size"] ** 0.5
        self.final_logit_softcapping = hf.get("final_logit_softcapping")

    def make_layer(self, hf, index, tp, head_dim, comm):
        return Gemma3DecoderLayer(hf, tp, head_dim, comm, self.layer_types[index], layer_sliding_windows(hf)[index])

    def make_norm(self, hidden, eps):
        return GemmaRMSNorm(hidden, eps)

    def make_rope(self, hf, head_dim, max_positions):
        return nn.ModuleDict(
            {
                t: RotaryEmbedding(gemma3_rope_config(hf, t), head_dim, max_positions)
                for t in sorted(set(self.layer_types))
            }
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # transformers multiplies by the scale cast to the weights' dtype
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        logits = self.lm_head(hidden)
        cap = self.final_logit_softcapping
        if cap is None or logits is None:
            return logits
        return torch.tanh(logits / cap) * cap
