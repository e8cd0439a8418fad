"""The Llama family (Llama, Mistral, Qwen2, SmolLM2) over a paged KV cache, for every tensor- and
pipeline-parallel size (one rank's part of it; the whole model at one rank).

Tokens of all requests are one flat batch [num_tokens, hidden]; attention is the only
place where requests are told apart (attention.layer.Attention, which reads the step's
metadata from the forward context). QKV and gate/up are fused
into one matrix product each: their layers load the checkpoint's separate matrices into one
parameter (stacked_params_mapping). distributed/sharding.py plans which heads, intermediate
columns, vocabulary rows and layers this rank holds; the layers (models/layers/) cut their
slices as they load.

Qwen 3, Mixtral, Qwen3-MoE, DeepSeek-V3 and Gemma 3 are subclasses: the hooks are `qk_norm`,
`LlamaDecoderLayer.make_mlp`, `LlamaForCausalLM.decoder_layer` (the layer class; `make_layer`
builds one per index), `make_norm`, `make_rope`, `embed` and `weight_name_mapping`. Each layer
reads its own sliding window from the config (`layer_sliding_windows`).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from pagedllm.attention.layer import Attention
from pagedllm.distributed.sharding import TPShard, plan_model_shard
from pagedllm.models.hf_config import layer_sliding_windows
from pagedllm.models.layers.activation import SiluAndMul
from pagedllm.models.layers.layernorm import RMSNorm
from pagedllm.models.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.models.layers.rotary_embedding import RotaryEmbedding
from pagedllm.models.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.models.layers.weight_utils import default_weight_loader
from pagedllm.models.utils import PPMissingLayer, pp_missing_prefixes


class LlamaAttention(nn.Module):
    """qk_norm: RMSNorm over each head's q and k before RoPE (Qwen 3); sliding_window: the layer
    attends to the last W tokens only (Mistral, Gemma 3's local layers)."""

    def __init__(
        self, hf: dict, tp: TPShard, head_dim: int, comm=None, qk_norm: bool = False, sliding_window=None
    ) -> None:
        super().__init__()
        hidden = hf["hidden_size"]
        bias = hf.get("attention_bias", False) or hf.get("model_type") == "qwen2"
        self.num_heads, self.num_kv_heads, self.head_dim = len(tp.q_heads), len(tp.kv_heads), head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, tp.q_heads, tp.kv_heads, bias)
        q_features = range(tp.q_heads.start * head_dim, tp.q_heads.stop * head_dim)
        self.o_proj = RowParallelLinear(q_features, hidden, hf.get("attention_bias", False), comm)
        self.scale = head_dim**-0.5
        self.attn = Attention(self.num_heads, head_dim, self.scale, self.num_kv_heads, sliding_window=sliding_window)
        eps = hf.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None

    def forward(self, x, positions, rope):
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # per head: rows of head_dim
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(T, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(T, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k)
        o = self.attn(q, k, v)
        return self.o_proj(o.reshape(T, self.q_size))


class LlamaMLP(nn.Module):
    """intermediate: this rank's range of the intermediate features."""

    def __init__(self, hidden: int, intermediate: range, bias: bool = False, comm=None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate], bias)
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, comm)

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # [T, 2I] -> [T, I] -> [T, H]


class LlamaDecoderLayer(nn.Module):
    """A subclass (Qwen 3, the MoE models) sets qk_norm and builds its own MLP (make_mlp)."""

    qk_norm = False

    def __init__(self, hf: dict, tp: TPShard, head_dim: int, comm=None, layer_idx: int = 0) -> None:
        super().__init__()
        eps = hf.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(hf["hidden_size"], eps)
        self.self_attn = LlamaAttention(hf, tp, head_dim, comm, self.qk_norm, layer_sliding_windows(hf)[layer_idx])
        self.post_attention_layernorm = RMSNorm(hf["hidden_size"], eps)
        self.mlp = self.make_mlp(hf, tp, comm, layer_idx)

    def make_mlp(self, hf: dict, tp: TPShard, comm, layer_idx: int) -> nn.Module:
        return LlamaMLP(hf["hidden_size"], tp.intermediate, hf.get("mlp_bias", False), comm)

    def forward(self, x, positions, rope, residual=None):
        """-> (this layer's MLP output, the residual stream before it): each residual add is
        done by the next RMSNorm (fused there where a fused op is), as in vLLM; None: x is
        the stream itself (the first layer of a stage)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    # Fused parameter -> the checkpoint matrices stacked into it, in order.
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    # (our name, checkpoint name, shard id): how load_weights routes a stacked matrix.
    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]
    decoder_layer = LlamaDecoderLayer

    def __init__(self, hf: dict, max_positions: int, parallel=None) -> None:
        """parallel (distributed.parallel_state.ParallelContext): this rank's shard; None: the
        whole model on one rank."""
        super().__init__()
        self.hf = hf
        shard = self.shard = parallel.shard if parallel is not None else plan_model_shard(hf, 1, 1, 0)
        comm = parallel.tp if parallel is not None else None
        tp, hidden, head_dim = shard.tp, hf["hidden_size"], shard.head_dim
        first, last = shard.is_first_stage, shard.is_last_stage
        # The embedding and the LM head live on stage 0 (the driver samples there); the final
        # norm on the last stage.
        self.embed_tokens = VocabParallelEmbedding(tp.vocab, hidden, comm) if first else PPMissingLayer()
        self.layers = nn.ModuleList(
            self.make_layer(hf, i, tp, head_dim, comm) if i in shard.layers else PPMissingLayer()
            for i in range(hf["num_hidden_layers"])
        )
        self.stage_layers = tuple(self.layers[i] for i in shard.layers)  # plain tuple: not registered twice
        self.norm = self.make_norm(hidden, hf.get("rms_norm_eps", 1e-6)) if last else PPMissingLayer()
        self.tie_word_embeddings = bool(hf.get("tie_word_embeddings", False))
        self.lm_head = (
            ParallelLMHead(
                tp.vocab, hidden, hf["vocab_size"], comm, tied=self.embed_tokens if self.tie_word_embeddings else None
            )
            if first
            else PPMissingLayer()
        )
        self.rope = self.make_rope(hf, head_dim, max_positions)

    # What a variant of the family builds differently (models/gemma3.py overrides these).
    def make_layer(self, hf: dict, index: int, tp: TPShard, head_dim: int, comm) -> nn.Module:
        return self.decoder_layer(hf, tp, head_dim, comm, index)

    def make_norm(self, hidden: int, eps: float) -> nn.Module:
        return RMSNorm(hidden, eps)

    def make_rope(self, hf: dict, head_dim: int, max_positions: int) -> nn.Module:
        """What each layer's forward gets as `rope`."""
        return RotaryEmbedding(hf, head_dim, max_positions)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_in: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden] (final-normed on the last stage),
        inside the runner's forward context. Stage 0 embeds input_ids; a later stage starts from
        hidden_in (the previous stage's output)."""
        x = self.embed(input_ids) if hidden_in is None else hidden_in
        residual = None
        for layer in self.stage_layers:
            x, residual = layer(x, positions, self.rope, residual)
        if residual is None:  # a stage without layers
            return self.norm(x)
        if isinstance(self.norm, PPMissingLayer):  # the stream itself goes to the next stage
            return x + residual
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """hidden [B, hidden] of the rows that sample -> logits [B, vocab] (float32); stage 0
        only, None on TP ranks other than 0."""
        return self.lm_head(hidden)

    def weight_name_mapping(self) -> list[tuple[str, str, object]]:
        """(our name part, checkpoint name part, shard id), first match wins: a subclass puts
        its own entries (experts, renamed modules) before these."""
        return self.stacked_params_mapping

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint (HF) tensors -> this rank's parameters, each layer cutting its own slice.
        Returns the names of the parameters loaded in full (every shard of a fused one).
        ValueError names a checkpoint tensor that fits no parameter."""
        params = dict(self.named_parameters())
        elsewhere = pp_missing_prefixes(self)
        mapping = self.weight_name_mapping()
        shards_needed = {fused: sum(f == fused for f, _, _ in mapping) for fused, _, _ in mapping}
        shards_seen: dict[str, set] = {}
        loaded = set()
        for ckpt_name, tensor in weights:
            name = ckpt_name.removeprefix("model.")
            if name.endswith("rotary_emb.inv_freq"):
                continue  # the RoPE tables are computed from the config
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # the LM head is the embedding
            shard_id, need = None, 1
            for fused, part, sid in mapping:
                if part in name:
                    name, shard_id, need = name.replace(part, fused), sid, shards_needed[fused]
                    break
            if name.startswith(elsewhere):
                continue  # held by another pipeline stage
            param = params.get(name)
            if param is None:
                raise ValueError(f"unexpected weight {ckpt_name!r}")
            try:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"weight {ckpt_name!r}: {e}") from e
            seen = shards_seen.setdefault(name, set())
            seen.add(shard_id)
            if len(seen) == need:
                loaded.add(name)
        return loaded
