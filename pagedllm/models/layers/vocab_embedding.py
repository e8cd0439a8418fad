"""The embedding and the LM head split by vocabulary range over the TP group (as vLLM's
vocab_parallel_embedding.py); with one rank (comm None or of size 1) plain ones.

- VocabParallelEmbedding: each rank holds a range of the vocabulary; ids outside it give
  zeros, and the all-reduce fills in every row.
- ParallelLMHead: each rank computes the logits of its vocabulary range (through its
  LinearMethod); TP rank 0 gathers them into the full [tokens, vocab] row (only it samples).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.sharding import split_range
from pagedllm.models.layers.linear import default_linear_method, multi_rank
from pagedllm.models.layers.linear_method import LinearMethodBase
from pagedllm.models.layers.quantization import current_quant_config
from pagedllm.models.layers.weight_utils import copy_weight


class VocabParallelEmbedding(nn.Module):
    """A quantization config with an embedding method (GGUF: the table held in its blocks)
    gives the weight's form and the lookup; the loader processes it as a linear's."""

    def __init__(self, vocab: range, hidden_size: int, comm=None) -> None:
        super().__init__()
        self.vocab = vocab
        quant = current_quant_config()
        method = quant.get_embedding_method() if hasattr(quant, "get_embedding_method") else None
        if method is not None:
            self.linear_method = method
            method.create_weights(self, hidden_size, len(vocab))
        else:
            self.weight = nn.Parameter(torch.empty(len(vocab), hidden_size), requires_grad=False)  # [V_rank, H]
        self.weight.weight_loader = self.weight_loader
        self.comm = multi_rank(comm)
        self.rows = None  # ids -> rows, where a tied LM head's method holds the table (hold_rows)

    def hold_rows(self, rows) -> None:
        """The tied LM head's method holds the table in its own layout: rows come from
        rows(ids) [*ids.shape, H], and the plain table goes."""
        self.rows = rows
        self.weight = None

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.rows is not None:
            return self.rows(ids)
        if self.weight is None:  # held quantized
            return self.linear_method.embed(self, ids)
        return F.embedding(ids, self.weight)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        copy_weight(param.data, loaded[self.vocab.start : self.vocab.stop])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm is None:
            return self._lookup(input_ids)
        inside = (input_ids >= self.vocab.start) & (input_ids < self.vocab.stop)
        out = self._lookup(torch.where(inside, input_ids - self.vocab.start, 0))
        out.masked_fill_(~inside[:, None], 0)
        return self.comm.all_reduce(out)


class ParallelLMHead(nn.Module):
    """tied: the embedding whose weight this head shares (tie_word_embeddings); its loader
    loads it."""

    def __init__(
        self,
        vocab: range,
        hidden_size: int,
        vocab_size: int,
        comm=None,
        tied: Optional[VocabParallelEmbedding] = None,
        linear_method: Optional[LinearMethodBase] = None,
    ) -> None:
        super().__init__()
        self.vocab = vocab
        self.vocab_size = vocab_size
        self.comm = multi_rank(comm)
        self.linear_method = linear_method or default_linear_method(lm_head=True)
        # The embedding whose weight this head shares (a tuple: not a submodule of the head). Its
        # method may hold the table in another layout, the embedding then reading rows from it.
        self.tied_to = (tied,) if tied is not None else ()
        if tied is not None:
            self.weight = tied.weight
        else:
            self.linear_method.create_weights(self, hidden_size, len(vocab))  # [V_rank, H]
            self.weight.weight_loader = self.weight_loader
        # Gather needs one shape: every rank's slice is padded to the largest.
        self.width = -(vocab_size // -comm.size) if self.comm is not None else len(vocab)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        copy_weight(param.data, loaded[self.vocab.start : self.vocab.stop])

    def forward(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """hidden [B, H] -> logits [B, vocab] (float32) on TP rank 0, None on the others."""
        logits = self.linear_method.apply(self, hidden).float()
        if self.comm is None:
            return logits
        parts = self.comm.gather(F.pad(logits, (0, self.width - logits.shape[1])), dst=0)
        if parts is None:
            return None
        return torch.cat(
            [p[:, : len(split_range(self.vocab_size, self.comm.size, i))] for i, p in enumerate(parts)], dim=1
        )
