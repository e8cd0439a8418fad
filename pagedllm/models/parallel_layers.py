"""Tensor-parallel layers (Megatron-LM style, as vLLM's): each holds one rank's slice of a
weight and does the one collective its split needs.

- ColumnParallelLinear: the output features are split (QKV, gate/up); no communication, each
  rank goes on with its own heads / intermediate slice.
- RowParallelLinear: the input features are split (o_proj, down_proj); each rank's partial
  product is summed over the TP group (all-reduce), then the bias is added once.
- VocabParallelEmbedding: each rank holds a range of the vocabulary; ids outside it give
  zeros, and the all-reduce fills in every row.
- ParallelLMHead: each rank computes the logits of its vocabulary range; TP rank 0 gathers
  them into the full [tokens, vocab] row (only it samples).
- PPMissingLayer: the placeholder for a layer that lives on another pipeline stage, so that
  parameter names keep their global layer index.

The groups are pagedllm.distributed.parallel_state.GroupComm; with one rank every collective
is a no-op, so these layers also run unsplit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.sharding import split_range


class ColumnParallelLinear(nn.Linear):
    """nn.Linear over this rank's output features; kept as its own type for readability."""


class RowParallelLinear(nn.Linear):
    def __init__(self, in_features_local: int, out_features: int, bias: bool, comm) -> None:
        super().__init__(in_features_local, out_features, bias=bias)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comm.all_reduce(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: range, hidden_size: int, comm) -> None:
        super().__init__()
        self.vocab = vocab
        self.weight = nn.Parameter(torch.empty(len(vocab), hidden_size))
        self.comm = comm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            return F.embedding(input_ids, self.weight)
        inside = (input_ids >= self.vocab.start) & (input_ids < self.vocab.stop)
        out = F.embedding(torch.where(inside, input_ids - self.vocab.start, 0), self.weight)
        out.masked_fill_(~inside[:, None], 0)
        return self.comm.all_reduce(out)


class ParallelLMHead(nn.Module):
    def __init__(self, vocab: range, hidden_size: int, vocab_size: int, comm) -> None:
        super().__init__()
        self.vocab = vocab
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(len(vocab), hidden_size))
        self.comm = comm

    def forward(self, hidden: torch.Tensor):
        """hidden [B, H] -> logits [B, vocab] (float32) on TP rank 0, None on the others."""
        logits = F.linear(hidden, self.weight).float()
        if self.comm.size == 1:
            return logits
        # Gather needs one shape: pad every slice to the largest, cut the padding off after.
        width = -(self.vocab_size // -self.comm.size)
        parts = self.comm.gather(F.pad(logits, (0, width - logits.shape[1])), dst=0)
        if parts is None:
            return None
        return torch.cat([p[:, :len(split_range(self.vocab_size, self.comm.size, i))]
                          for i, p in enumerate(parts)], dim=1)


class PPMissingLayer(nn.Identity):
    """A layer held by another pipeline stage."""
