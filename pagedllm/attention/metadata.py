"""AttentionMetadata: per-step index tensors, built once and read by every layer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch


@dataclass
class PrefillChunk:
    """A request with more than one new token: causal inside the chunk, full over its past."""
    start: int                        # its tokens are [start, end) of the step
    end: int
    kv_slots: Optional[torch.Tensor]  # [seq_len] cache slots to read; None: no past, use new K/V
    mask: Optional[torch.Tensor]      # [q_len, seq_len] bool; None: plain causal


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor                  # [num_tokens] where each new K/V is written
    # Requests with one new token (decodes), attended together in one batched call.
    decode_token_idx: Optional[torch.Tensor]    # [Bd] token index of each decode query
    decode_kv_slots: Optional[torch.Tensor]     # [Bd, L] cache slots, padded with slot 0
    decode_mask: Optional[torch.Tensor]         # [Bd, 1, 1, L] bool, True = attend
    # For the C++ kernel, which reads pages through the block table instead of gathered slots.
    decode_block_table: Optional[torch.Tensor]  # [Bd, max_blocks] int32
    decode_seq_lens: Optional[torch.Tensor]     # [Bd] int32
    block_size: int
    prefills: list[PrefillChunk]
    all_decode: bool


def build_attention_metadata(query_start_loc: np.ndarray, seq_lens: np.ndarray,
                             block_table: np.ndarray, block_size: int,
                             slot_mapping: torch.Tensor, decode_by_pages: bool = False) -> AttentionMetadata:
    """query_start_loc [num_reqs+1], seq_lens [num_reqs], block_table [num_reqs, max_blocks].
    decode_by_pages: the decode kernel reads pages itself (no slot matrix needed)."""
    q_lens = np.diff(query_start_loc)
    computed = seq_lens - q_lens
    decode_rows = np.nonzero(q_lens == 1)[0]
    offsets = np.arange(block_size)

    def slots_of(rows: np.ndarray, length: int) -> np.ndarray:
        nb = -(length // -block_size)
        return (block_table[rows, :nb, None].astype(np.int64) * block_size + offsets).reshape(len(rows), -1)[:, :length]

    decode_token_idx = decode_kv_slots = decode_mask = decode_bt = decode_sl = None
    if len(decode_rows) and decode_by_pages:
        L = int(seq_lens[decode_rows].max())
        decode_token_idx = torch.from_numpy(query_start_loc[decode_rows].astype(np.int64))
        decode_bt = torch.from_numpy(np.ascontiguousarray(block_table[decode_rows, :-(L // -block_size)]))
        decode_sl = torch.from_numpy(seq_lens[decode_rows].astype(np.int32))
    elif len(decode_rows):
        L = int(seq_lens[decode_rows].max())
        slots = slots_of(decode_rows, L)                                        # [Bd, L]
        valid = np.arange(L)[None, :] < seq_lens[decode_rows][:, None]          # [Bd, L]
        decode_token_idx = torch.from_numpy(query_start_loc[decode_rows].astype(np.int64))
        decode_kv_slots = torch.from_numpy(np.where(valid, slots, 0))
        decode_mask = torch.from_numpy(valid)[:, None, None, :]

    prefills = []
    for row in np.nonzero(q_lens > 1)[0]:
        start, end = int(query_start_loc[row]), int(query_start_loc[row + 1])
        c, s = int(computed[row]), int(seq_lens[row])
        if c == 0:
            prefills.append(PrefillChunk(start, end, None, None))
        else:
            kv_slots = torch.from_numpy(slots_of(np.array([row]), s)[0])
            mask = torch.arange(s)[None, :] <= (c + torch.arange(end - start))[:, None]
            prefills.append(PrefillChunk(start, end, kv_slots, mask))
    return AttentionMetadata(slot_mapping, decode_token_idx, decode_kv_slots, decode_mask,
                             decode_bt, decode_sl, block_size, prefills, all_decode=not prefills)
