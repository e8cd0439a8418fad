"""AttentionMetadata: per-step index tensors, built once and read by every layer (and once more
per sliding window, for the layers that have one: `AttentionMetadata.windowed`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch


@dataclass
class PrefillChunk:
    """A request with more than one new token: causal inside the chunk, full over its past (or
    over the last W tokens of it, in a sliding window)."""

    start: int  # its tokens are [start, end) of the step
    end: int
    kv_slots: Optional[torch.Tensor]  # [num_keys] cache slots to read; None: no past, use new K/V
    mask: Optional[torch.Tensor]  # [q_len, num_keys] bool; None: plain causal


@dataclass
class PrefillPages:
    """The step's prefill chunks as the C++ prefill kernel reads them: through the block table
    (csrc/prefill_attention.cpp), no slots or masks. [P] int32 each, one entry a chunk."""

    q_start: torch.Tensor  # its first token in the step
    q_len: torch.Tensor  # its new tokens
    seq_lens: torch.Tensor  # cached + new tokens
    block_table: torch.Tensor  # [P, max_blocks] int32


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new K/V is written
    # Requests with one new token (decodes), attended together in one batched call.
    decode_token_idx: Optional[torch.Tensor]  # [Bd] token index of each decode query
    decode_kv_slots: Optional[torch.Tensor]  # [Bd, L] cache slots, padded with slot 0
    decode_mask: Optional[torch.Tensor]  # [Bd, 1, 1, L] bool, True = attend
    # For the C++ kernel, which reads pages through the block table instead of gathered slots.
    decode_block_table: Optional[torch.Tensor]  # [Bd, max_blocks] int32
    decode_seq_lens: Optional[torch.Tensor]  # [Bd] int32
    block_size: int
    all_decode: bool
    sliding_window: Optional[int] = None  # the window the slots and masks are cut to
    max_decode_query_len: int = 1  # build_attention_metadata's
    prefill_pages: Optional[PrefillPages] = None  # for the C++ prefill kernel (prefill_by_pages)
    # The torch path's PrefillChunk list, or the function that builds it on first use (a step
    # whose chunks the C++ kernel takes builds no masks).
    prefill_chunks: Any = field(default=(), repr=False)
    # Chunks whose images' tokens attend to each other both ways (build_attention_metadata's
    # `bidirectional`): masked torch-path chunks, left out of prefill_pages.
    masked_prefills: list = field(default_factory=list, repr=False)
    bidirectional: Optional[dict] = field(default=None, repr=False)
    # What it was built from, to build the same step for another window (once each).
    inputs: tuple = field(default=(), repr=False)
    by_window: dict = field(default_factory=dict, repr=False)

    @property
    def prefills(self) -> list[PrefillChunk]:
        """The prefill chunks' slots and masks for the torch path."""
        if callable(self.prefill_chunks):
            self.prefill_chunks = self.prefill_chunks()
        return self.prefill_chunks

    def windowed(self, sliding_window: Optional[int]) -> "AttentionMetadata":
        """This step's metadata for a layer with that sliding window (None: self)."""
        if sliding_window is None or sliding_window == self.sliding_window:
            return self
        if sliding_window not in self.by_window:
            self.by_window[sliding_window] = build_attention_metadata(
                *self.inputs,
                sliding_window=sliding_window,
                max_decode_query_len=self.max_decode_query_len,
                prefill_by_pages=self.prefill_pages is not None or bool(self.masked_prefills),
                bidirectional=self.bidirectional,
            )
        return self.by_window[sliding_window]


def build_attention_metadata(
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    slot_mapping: torch.Tensor,
    decode_by_pages: bool = False,
    sliding_window: Optional[int] = None,
    max_decode_query_len: int = 1,
    prefill_by_pages: bool = False,
    bidirectional: Optional[dict] = None,
) -> AttentionMetadata:
    """query_start_loc [num_reqs+1], seq_lens [num_reqs], block_table [num_reqs, max_blocks].
    decode_by_pages: the decode kernel reads pages itself (no slot matrix needed).
    prefill_by_pages: the prefill chunks' PrefillPages too, for the C++ prefill kernel (their
    slot / mask list is then built only if a layer asks for it: a quantized cache).
    max_decode_query_len Q: a request with 2..Q new tokens over a past (a speculative
    verification step's k + 1) attends as that many decode queries, query j over the request's
    first computed + j + 1 keys (causal: its own K/V are written before any query reads); each
    is the very call a one-token decode of that token makes.
    sliding_window W: a query at position p attends to keys (p - W, p] only (transformers'
    sliding-window mask); keys before the window are never gathered, so their blocks may have
    been freed (the block table may name a block another request now holds).
    bidirectional {request row: [(lo, hi), ...]}: token spans (an image's, in sequence positions)
    whose tokens attend to each other both ways (transformers' block mask: OR(causal, same
    span), then AND the window); each span's tokens this step include its last, the ones before
    the chunk are past. Those rows attend as masked prefill chunks, never by the kernels."""
    q_lens = np.diff(query_start_loc)
    computed = seq_lens - q_lens
    as_decode = (q_lens == 1) | ((q_lens <= max_decode_query_len) & (computed > 0))
    spans = bidirectional or {}
    as_decode[list(spans)] = False
    # One decode query per new token of those requests, in token order: its request row, its
    # token index and its number of keys; [Bd] each.
    rows = np.nonzero(as_decode)[0]
    per_row = q_lens[rows]
    decode_rows = np.repeat(rows, per_row)
    within = np.arange(int(per_row.sum())) - np.repeat(np.cumsum(per_row) - per_row, per_row)  # j in its request
    decode_tok = query_start_loc[decode_rows] + within
    decode_lens = computed[decode_rows] + within + 1

    def first_key(query_pos):
        """The first key a query at query_pos attends to."""
        return np.maximum(query_pos - sliding_window + 1, 0) if sliding_window else np.zeros_like(query_pos)

    def slots_at(rows: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """pos [len(rows), L] token positions -> their cache slots."""
        return block_table[rows[:, None], pos // block_size].astype(np.int64) * block_size + pos % block_size

    decode_token_idx = decode_kv_slots = decode_mask = decode_bt = decode_sl = None
    if len(decode_rows) and decode_by_pages:  # the kernel cuts the window itself
        L = int(decode_lens.max())
        decode_token_idx = torch.from_numpy(decode_tok.astype(np.int64))
        decode_bt = torch.from_numpy(np.ascontiguousarray(block_table[decode_rows, : -(L // -block_size)]))
        decode_sl = torch.from_numpy(decode_lens.astype(np.int32))
    elif len(decode_rows):
        lens = decode_lens.astype(np.int64)
        start = first_key(lens - 1)  # [Bd]
        n = lens - start
        L = int(n.max())
        valid = np.arange(L)[None, :] < n[:, None]  # [Bd, L]
        pos = np.where(valid, start[:, None] + np.arange(L), 0)
        decode_token_idx = torch.from_numpy(decode_tok.astype(np.int64))
        decode_kv_slots = torch.from_numpy(np.where(valid, slots_at(decode_rows, pos), 0))
        decode_mask = torch.from_numpy(valid)[:, None, None, :]

    prefill_rows = np.nonzero(~as_decode)[0]
    paged_rows = np.array([r for r in prefill_rows if r not in spans], dtype=np.int64)
    prefill_pages = None
    if prefill_by_pages and len(paged_rows):
        nb = -(-int(seq_lens[paged_rows].max()) // block_size)
        i32 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))  # noqa: E731
        prefill_pages = PrefillPages(
            i32(query_start_loc[paged_rows]),
            i32(q_lens[paged_rows]),
            i32(seq_lens[paged_rows]),
            i32(block_table[paged_rows, :nb]),
        )

    def prefill_chunks(rows) -> list[PrefillChunk]:
        prefills = []
        for row in rows:
            start, end = int(query_start_loc[row]), int(query_start_loc[row + 1])
            c, s = int(computed[row]), int(seq_lens[row])
            if c == 0 and (not sliding_window or s <= sliding_window) and row not in spans:
                prefills.append(PrefillChunk(start, end, None, None))
                continue
            k0 = int(first_key(np.int64(c)))
            kpos, qpos = np.arange(k0, s), np.arange(c, s)
            mask = kpos[None, :] <= qpos[:, None]  # [q_len, s - k0]
            for lo, hi in spans.get(row, ()):  # a loop over the row's images
                mask |= ((qpos >= lo) & (qpos < hi))[:, None] & ((kpos >= lo) & (kpos < hi))[None, :]
            if sliding_window:
                mask &= kpos[None, :] > qpos[:, None] - sliding_window
            # No past: the chunk's own K/V (k0 is 0), windowed by the mask.
            kv_slots = None if c == 0 else torch.from_numpy(slots_at(np.array([row]), kpos[None, :])[0])
            prefills.append(PrefillChunk(start, end, kv_slots, torch.from_numpy(mask)))
        return prefills

    inputs = (query_start_loc, seq_lens, block_table, block_size, slot_mapping, decode_by_pages)
    chunks = (lambda: prefill_chunks(prefill_rows)) if prefill_by_pages else prefill_chunks(prefill_rows)
    return AttentionMetadata(
        slot_mapping,
        decode_token_idx,
        decode_kv_slots,
        decode_mask,
        decode_bt,
        decode_sl,
        block_size,
        all_decode=not len(prefill_rows),
        sliding_window=sliding_window,
        max_decode_query_len=max_decode_query_len,
        prefill_pages=prefill_pages,
        prefill_chunks=chunks,
        masked_prefills=prefill_chunks(sorted(spans)) if prefill_by_pages else [],
        bidirectional=bidirectional,
        inputs=inputs,
    )
