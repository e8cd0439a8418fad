"""The Llama family (Llama, Mistral, Qwen2, SmolLM2) over a paged KV cache.

Tokens of all requests are one flat batch [num_tokens, hidden]; attention is the only
place where requests are told apart (attention.layer.Attention, which reads the step's
metadata from the forward context). QKV and gate/up are fused into one matrix product each at
load time.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.layer import Attention
from pagedllm.models.hf_config import head_dim_of


class RMSNorm(nn.Module):
    ops = None   # fused CPU ops (models/cpu_ops.py), set at load time where they apply

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        # As transformers: normalise in float32, then scale.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(hf: dict, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the attention scaling of the config's RoPE."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    partial = hf.get("partial_rotary_factor", 1.0)
    dim = int(head_dim * partial)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    cfg = {**scaling, **params}
    if kind == "linear":
        inv_freq = inv_freq / cfg["factor"]
    elif kind == "llama3":
        factor, low, high = cfg["factor"], cfg["low_freq_factor"], cfg["high_freq_factor"]
        old_len = cfg["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind != "default":
        raise ValueError(f"rope type {kind!r} is not supported (default, linear, llama3)")
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed once at start-up."""
    ops = None   # fused CPU ops (models/cpu_ops.py): rotate q and k in place

    def __init__(self, hf: dict, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(hf, head_dim)
        t = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)                       # [P, rot/2]
        emb = torch.cat((freqs, freqs), dim=-1)                 # [P, rot]
        self.register_buffer("cos", emb.cos() * self.attention_scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * self.attention_scaling, persistent=False)
        self.rot_dim = emb.shape[-1]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions [T]; q [T, H, D], k [T, Hkv, D] -> rotated (rotate-half convention)."""
        if self.ops is not None:
            self.ops.rotary_embedding_(q, k, self.cos, self.sin, positions)
            return q, k
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)     # [T, 1, rot]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin, self.rot_dim), _rotate(k, cos, sin, self.rot_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> torch.Tensor:
    xr, rest = x[..., :rot], x[..., rot:]
    x1, x2 = xr.chunk(2, dim=-1)
    out = xr * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


class LlamaAttention(nn.Module):
    def __init__(self, hf: dict, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        hidden = hf["hidden_size"]
        bias = hf.get("attention_bias", False) or hf.get("model_type") == "qwen2"
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=hf.get("attention_bias", False))
        self.scale = head_dim ** -0.5
        self.attn = Attention(num_heads, head_dim, self.scale, num_kv_heads)

    def forward(self, x, positions, rope):
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k)
        o = self.attn(q, k, v)
        return self.o_proj(o.reshape(T, self.q_size))


class LlamaMLP(nn.Module):
    ops = None   # fused CPU ops (models/cpu_ops.py): silu(gate) * up in one pass

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x):
        gate_up = self.gate_up_proj(x)                                  # [T, 2I]
        if self.ops is not None:
            return self.down_proj(self.ops.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hf: dict, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        eps = hf.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(hf["hidden_size"], eps)
        self.self_attn = LlamaAttention(hf, num_heads, num_kv_heads, head_dim)
        self.post_attention_layernorm = RMSNorm(hf["hidden_size"], eps)
        self.mlp = LlamaMLP(hf["hidden_size"], hf["intermediate_size"], hf.get("mlp_bias", False))

    def forward(self, x, positions, rope):
        x = x + self.self_attn(self.input_layernorm(x), positions, rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, hf: dict, max_positions: int) -> None:
        super().__init__()
        self.hf = hf
        num_heads = hf["num_attention_heads"]
        num_kv_heads = hf.get("num_key_value_heads", num_heads)
        head_dim = head_dim_of(hf)
        self.embed_tokens = nn.Embedding(hf["vocab_size"], hf["hidden_size"])
        self.layers = nn.ModuleList(LlamaDecoderLayer(hf, num_heads, num_kv_heads, head_dim)
                                    for _ in range(hf["num_hidden_layers"]))
        self.norm = RMSNorm(hf["hidden_size"], hf.get("rms_norm_eps", 1e-6))
        self.tie_word_embeddings = hf.get("tie_word_embeddings", False)
        self.lm_head = nn.Linear(hf["hidden_size"], hf["vocab_size"], bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(hf, head_dim, max_positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (inside the runner's
        forward context)."""
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, positions, self.rope)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, hidden] of the rows that sample -> logits [B, vocab] (float32)."""
        return self.lm_head(hidden).float()
