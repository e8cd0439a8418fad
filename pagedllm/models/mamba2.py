"""Mamba2 (transformers' Mamba2ForCausalLM): every layer a Mamba2 mixer (models/layers/mamba/),
no attention, so the KV cache is one recurrent-state group: each request holds one block, its
conv and SSM states of every layer, whatever its length (worker/state_cache.py).

Layers are pre-norm residual blocks (RMSNorm, mixer, add), the residual add done by the next
norm as in models/llama.py; a final RMSNorm (norm_f) and the LM head. One rank only."""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from pagedllm.models.layers.layernorm import RMSNorm
from pagedllm.models.layers.mamba.mamba_mixer2 import Mamba2Mixer
from pagedllm.models.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.models.layers.weight_utils import default_weight_loader


def refuse_parallel(parallel, arch: str) -> None:
    if parallel is not None:
        raise ValueError(
            f"{arch} runs on one rank: tensor_parallel_size and pipeline_parallel_size must be 1 "
            "(its recurrent layers are not split)"
        )


class Mamba2Block(nn.Module):
    def __init__(self, hf: dict) -> None:
        super().__init__()
        self.norm = RMSNorm(hf["hidden_size"], hf.get("layer_norm_epsilon", 1e-5))
        self.mixer = Mamba2Mixer(hf)

    def forward(self, x, residual=None):
        x, residual = (self.norm(x), x) if residual is None else self.norm(x, residual)
        return self.mixer(x), residual


class Mamba2ForCausalLM(nn.Module):
    # checkpoint name part -> ours (the mixer's conv and norm are plain parameters here)
    renames = (
        (".mixer.conv1d.weight", ".mixer.conv1d_weight"),
        (".mixer.conv1d.bias", ".mixer.conv1d_bias"),
        (".mixer.norm.weight", ".mixer.norm_weight"),
        ("embedding.", "embeddings."),
    )

    def __init__(self, hf: dict, max_positions: int, parallel=None) -> None:
        super().__init__()
        refuse_parallel(parallel, "Mamba2")
        hidden, vocab = hf["hidden_size"], hf["vocab_size"]
        self.embeddings = VocabParallelEmbedding(range(vocab), hidden)
        self.layers = nn.ModuleList(Mamba2Block(hf) for _ in range(hf["num_hidden_layers"]))
        self.norm_f = RMSNorm(hidden, hf.get("layer_norm_epsilon", 1e-5))
        self.tie_word_embeddings = bool(hf.get("tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(
            range(vocab), hidden, vocab, tied=self.embeddings if self.tie_word_embeddings else None
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_in: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """input_ids [T] -> final-normed hidden states [T, hidden] (positions are not used: the
        state carries the order)."""
        x, residual = self.embeddings(input_ids) if hidden_in is None else hidden_in, None
        for layer in self.layers:
            x, residual = layer(x, residual)
        return self.norm_f(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params, loaded = dict(self.named_parameters()), set()
        for ckpt_name, tensor in weights:
            name = ckpt_name.removeprefix("backbone.")
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            for part, ours in self.renames:
                name = name.replace(part, ours)
            param = params.get(name)
            if param is None:
                raise ValueError(f"unexpected weight {ckpt_name!r}")
            try:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            except ValueError as e:
                raise ValueError(f"weight {ckpt_name!r}: {e}") from e
            loaded.add(name)
        return loaded
