"""DeepSeek-V3's multi-token prediction (MTP) modules, as a proposer for speculative decoding
(vLLM's DeepSeekMTP).

The checkpoint holds num_nextn_predict_layers of them after the main model's layers, under
model.layers.{num_hidden_layers + k}. (transformers skips these names.) Module k predicts the
token two (k + 2) positions ahead: from the main model's last-layer hidden state h_i (before
the final norm; module k > 0 takes module k - 1's output) and the embedding of the next token
t_{i+1}:

    h'_i   = eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)])      (DeepSeek-V3 eq. 21; the checkpoint's
                                                             eh_proj takes the embedding half
                                                             first, as DeepSeek's and vLLM's code)
    h''    = TRM_k(h'_{1..i})                               (a DeepSeek-V3 decoder layer: MLA +
                                                             MoE / MLP, causal over the sequence)
    logits = head(norm(h''_i))                              (shared_head.norm / shared_head.head)

Each module keeps its own embed_tokens and head copies (the checkpoint's), and its decoder
layer has its own MLA attention, hence its own latent KV cache: `attention_layers(mtp)` /
`get_kv_cache_spec` give it like the main model's, and the proposer binds and pages it.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from pagedllm.distributed.sharding import plan_model_shard
from pagedllm.models.deepseek_v3 import (
    DeepseekV3DecoderLayer,
    check_mla_config,
    deepseek_weight_name_mapping,
    deinterleave_rope,
    layer_index,
)
from pagedllm.models.layers.layernorm import RMSNorm
from pagedllm.models.layers.linear import ReplicatedLinear
from pagedllm.models.layers.rotary_embedding import RotaryEmbedding
from pagedllm.models.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.models.llama import LlamaForCausalLM


class SharedHead(nn.Module):
    def __init__(self, hf: dict, vocab: range, comm=None) -> None:
        super().__init__()
        self.norm = RMSNorm(hf["hidden_size"], hf.get("rms_norm_eps", 1e-6))
        self.head = ParallelLMHead(vocab, hf["hidden_size"], hf["vocab_size"], comm)


class DeepSeekMultiTokenPredictorLayer(DeepseekV3DecoderLayer):
    """One MTP module: its decoder layer's parameters keep the checkpoint's names
    (layers.{i}.self_attn..., .mlp...), beside enorm, hnorm, eh_proj, shared_head, embed_tokens."""

    def __init__(self, hf: dict, tp, comm, layer_idx: int) -> None:
        super().__init__(hf, tp, 0, comm, layer_idx)
        hidden, eps = hf["hidden_size"], hf.get("rms_norm_eps", 1e-6)
        self.embed_tokens = VocabParallelEmbedding(tp.vocab, hidden, comm)
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden, bias=False)
        self.shared_head = SharedHead(hf, tp.vocab, comm)

    def predict(
        self, hidden: torch.Tensor, next_token_ids: torch.Tensor, positions: torch.Tensor, rope
    ) -> torch.Tensor:
        """h [T, H], t_{i+1} [T], positions [T] -> this module's output hidden states [T, H]."""
        e = self.enorm(self.embed_tokens(next_token_ids))
        x = self.eh_proj(torch.cat((e, self.hnorm(hidden)), dim=-1))  # [T, 2H] -> [T, H]
        out, residual = super().forward(x, positions, rope)
        return out + residual


class DeepSeekMTP(nn.Module):
    """The checkpoint's MTP modules (the proposer's model). forward -> hidden states (the next
    module's input); compute_logits -> logits, as the main model's pair."""

    tie_word_embeddings = False

    def __init__(self, hf: dict, max_positions: int, parallel=None) -> None:
        super().__init__()
        check_mla_config(hf)
        self.hf = hf
        num = hf.get("num_nextn_predict_layers") or 0
        if num < 1:
            raise ValueError("the config has no MTP module (num_nextn_predict_layers is 0)")
        shard = parallel.shard if parallel is not None else plan_model_shard(hf, 1, 1, 0)
        comm = parallel.tp if parallel is not None else None
        self.first = hf["num_hidden_layers"]
        self.num_modules = num
        self.layers = nn.ModuleDict(
            {
                str(self.first + k): DeepSeekMultiTokenPredictorLayer(hf, shard.tp, comm, self.first + k)
                for k in range(num)
            }
        )
        self.rope = RotaryEmbedding(hf, hf["qk_rope_head_dim"], max_positions)

    def _module(self, spec_step_idx: int) -> DeepSeekMultiTokenPredictorLayer:
        return self.layers[str(self.first + spec_step_idx % self.num_modules)]

    def forward(
        self, hidden_states: torch.Tensor, next_token_ids: torch.Tensor, positions: torch.Tensor, spec_step_idx: int = 0
    ) -> torch.Tensor:
        """hidden_states [T, H]: the main model's last decoder layer output (before its final
        norm) at positions [T]; next_token_ids [T]: the token after each -> [T, H], whose
        logits (compute_logits) predict the token after next. Inside a forward context whose
        metadata pages this module's cache."""
        return self._module(spec_step_idx).predict(hidden_states, next_token_ids, positions, self.rope)

    def compute_logits(self, hidden: torch.Tensor, spec_step_idx: int = 0) -> Optional[torch.Tensor]:
        """[B, H] -> [B, vocab] float32 (None on TP ranks other than 0)."""
        head = self._module(spec_step_idx).shared_head
        return head.head(head.norm(hidden))

    def weight_name_mapping(self):
        return deepseek_weight_name_mapping(self.hf)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Only the MTP layers' tensors (model.layers.{n + k}.*) of the whole checkpoint, loaded
        by the Llama family's loop (same names, mapping and weight loaders)."""
        mine = range(self.first, self.first + self.num_modules)
        return LlamaForCausalLM.load_weights(
            self, deinterleave_rope(self.hf, ((name, t) for name, t in weights if layer_index(name) in mine))
        )
