"""The interface every attention backend implements (vLLM v1's AttentionBackend + its metadata
builder and impl, folded into one object: our backends keep no per-layer state).

A backend is chosen once per engine (attention/selector.py). Each step the runner asks it for
the step's metadata (`build_metadata`), publishes that in the forward context, and every
`Attention` layer calls `forward` with its own KV cache. A backend that can run a decode step
inside a CUDA graph says so (`supports_cuda_graphs`) and builds the static metadata a captured
step is recorded with (`build_graph_metadata`). A backend that runs multi-head latent attention
(DeepSeek's MLA layers, attention/mla_attention.py) says so (`supports_mla`) and implements
`forward_mla` over the same metadata.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional

import torch


class AttentionBackend(ABC):
    name: str = ""
    supports_cuda_graphs: bool = False
    supports_sliding_window: bool = False  # layers with a sliding window (attention.layer.Attention)
    supports_mla: bool = False  # MLA layers (attention.mla_attention.MLAAttention)
    # build_metadata takes `bidirectional` {request row: [(lo, hi), ...]}: spans of tokens (an
    # image's, Gemma 3) that attend to each other both ways at prefill.
    supports_bidirectional_spans: bool = False

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    @abstractmethod
    def build_metadata(
        self,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_size: int,
        max_query_len: Optional[int] = None,
        max_seq_len: Optional[int] = None,
    ) -> Any:
        """The step's metadata, shared by every layer. Host tensors: query_start_loc
        [num_reqs+1] int32, seq_lens [num_reqs] int32, block_table [num_reqs, >= blocks in use]
        int32, slot_mapping [num_tokens] int64; max_query_len / max_seq_len: host ints when
        known (else computed from the arrays)."""

    @abstractmethod
    def forward(
        self,
        layer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: Any,
    ) -> torch.Tensor:
        """Write this step's k/v [T, Hkv, D] into kv_cache (K, V: [num_slots, Hkv, D]) at the
        metadata's slot_mapping, then attend: q [T, H, D] -> out [T, H, D]. `layer` is the
        calling attention.layer.Attention (scale, head counts)."""

    def forward_mla(
        self,
        layer,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        w_kv_b: torch.Tensor,
        kv_cache: tuple[torch.Tensor],
        meta: Any,
    ) -> torch.Tensor:
        """MLA: write this step's latent rows [kv_c, k_pe] into kv_cache ((cache,), cache
        [S, R + dr]) at the slot mapping, then attend: q_nope [T, H, dn], q_pe [T, H, dr], kv_c
        [T, R], k_pe [T, dr], w_kv_b: kv_b_proj's weight [H * (dn + dv), R] -> out [T, H, dv].
        `layer` is the calling MLAAttention (scale)."""
        raise NotImplementedError(f"the {self.name} attention backend does not run MLA layers")

    def build_graph_metadata(
        self,
        slot_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        num_kv_heads: int,
        block_size: int,
        max_model_len: int,
        max_query_len: int = 1,
    ) -> Any:
        """The metadata a captured step of len(seq_lens) requests is recorded with: it reads the
        given static device buffers, and must serve every context length up to max_model_len
        and every split of the tokens among the requests (worker/cuda_graph.py). max_query_len
        1: a decode step (one token per request); more: a mixed step's tile shapes."""
        raise NotImplementedError(f"the {self.name} attention backend does not run CUDA graphs")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device})"
