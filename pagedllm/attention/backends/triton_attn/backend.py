"""The GPU backend: Triton kernels (kernels.py, launched by paged_attention.py; MLA's in
mla.py), index tensors on the device (metadata.py), CUDA-graph capture of decode steps."""

from __future__ import annotations

from typing import Optional

import torch

from pagedllm.attention.backends.abstract import AttentionBackend
from pagedllm.attention.backends.triton_attn.metadata import TritonAttentionMetadata, build_triton_metadata
from pagedllm.attention.backends.triton_attn.mla import mla_attention_triton
from pagedllm.attention.backends.triton_attn.paged_attention import choose_num_splits, num_sms, paged_attention


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True
    supports_sliding_window = True  # the window is the kernel's SLIDING_WINDOW
    supports_mla = True  # the absorbed form for every token (mla.py)

    def build_metadata(
        self,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_size: int,
        max_query_len: Optional[int] = None,
        max_seq_len: Optional[int] = None,
    ) -> TritonAttentionMetadata:
        if max_seq_len is not None:  # only the block-table columns in use travel to the device
            block_table = block_table[:, : -(max_seq_len // -block_size)]
        return build_triton_metadata(
            query_start_loc,
            seq_lens,
            block_table,
            block_size,
            slot_mapping,
            device=self.device,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
        )

    def forward(self, layer, q, k, v, kv_cache, meta: TritonAttentionMetadata) -> torch.Tensor:
        return paged_attention(
            q,
            k,
            v,
            kv_cache[0],
            kv_cache[1],
            meta,
            layer.scale,
            kv_scales=tuple(kv_cache[2:]) or None,
            sliding_window=layer.sliding_window,
        )

    def forward_mla(
        self, layer, q_nope, q_pe, kv_c, k_pe, w_kv_b, kv_cache, meta: TritonAttentionMetadata
    ) -> torch.Tensor:
        return mla_attention_triton(q_nope, q_pe, kv_c, k_pe, kv_cache[0], w_kv_b, meta, layer.scale)

    def build_graph_metadata(
        self,
        slot_mapping,
        query_start_loc,
        seq_lens,
        block_table,
        num_kv_heads: int,
        block_size: int,
        max_model_len: int,
        max_query_len: int = 1,
    ) -> TritonAttentionMetadata:
        """max_seq_len max_model_len: with max_query_len it only chooses the tile shapes and the
        split-K count (the kernels read each request's lengths from query_start_loc and
        seq_lens), so one graph serves every context length and every split of its tokens."""
        splits = choose_num_splits(
            len(seq_lens), num_kv_heads, max_query_len, max_model_len, num_sms(block_table.device)
        )
        return TritonAttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=block_table,
            block_size=block_size,
            max_query_len=max_query_len,
            max_seq_len=max_model_len,
            num_splits=splits,
        )
