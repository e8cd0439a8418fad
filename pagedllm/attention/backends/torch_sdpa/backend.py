"""The reference backend: plain torch, SDPA over the gathered slots of each request
(paged_attention.py does the work; metadata.py builds its metadata; mla.py is its MLA path)."""

from __future__ import annotations

from typing import Optional

import torch

from pagedllm.attention.backends.abstract import AttentionBackend
from pagedllm.attention.backends.torch_sdpa.metadata import AttentionMetadata, build_attention_metadata
from pagedllm.attention.backends.torch_sdpa.mla import mla_attention_torch
from pagedllm.attention.backends.torch_sdpa.paged_attention import paged_attention


class TorchSDPABackend(AttentionBackend):
    name = "torch"
    decode_by_pages = False  # decodes gather their slots into a [Bd, L] matrix
    prefill_by_pages = False  # prefill chunks gather their slots, SDPA a chunk
    max_decode_query_len = 1  # a request with more new tokens attends as a prefill chunk
    supports_sliding_window = True
    supports_mla = True
    supports_bidirectional_spans = True  # build_metadata's `bidirectional` (Gemma 3's images)
    attend = staticmethod(paged_attention)  # the forward's kernel (the CPU backend's differs)

    def build_metadata(
        self,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_size: int,
        max_query_len: Optional[int] = None,
        max_seq_len: Optional[int] = None,
        bidirectional: Optional[dict] = None,
    ) -> AttentionMetadata:
        return build_attention_metadata(
            query_start_loc.numpy(),
            seq_lens.numpy(),
            block_table.numpy(),
            block_size,
            slot_mapping,
            decode_by_pages=self.decode_by_pages,
            max_decode_query_len=self.max_decode_query_len,
            prefill_by_pages=self.prefill_by_pages,
            bidirectional=bidirectional,
        )

    def forward(self, layer, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        return self.attend(
            q,
            k,
            v,
            kv_cache[0],
            kv_cache[1],
            meta.windowed(layer.sliding_window),
            layer.scale,
            kv_scales=tuple(kv_cache[2:]) or None,
        )

    def forward_mla(self, layer, q_nope, q_pe, kv_c, k_pe, w_kv_b, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        return mla_attention_torch(q_nope, q_pe, kv_c, k_pe, kv_cache[0], w_kv_b, meta, layer.scale)
