"""The Triton backend's step metadata: the torch backend's index arrays moved to the device once
a step and shared by every layer (and, for a CUDA graph, static buffers: backend.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64 (a negative slot is not written)
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    block_size: int
    max_query_len: int
    max_seq_len: int
    num_splits: Optional[int] = None  # None: choose per call (split-K only for all-decode batches)

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def all_decode(self) -> bool:
        return self.max_query_len <= 1


def _as_tensor(x, dtype, device) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x))
    return x.to(device=device, dtype=dtype, non_blocking=True)


def build_triton_metadata(
    query_start_loc: Union[np.ndarray, torch.Tensor],
    seq_lens: Union[np.ndarray, torch.Tensor],
    block_table: Union[np.ndarray, torch.Tensor],
    block_size: int,
    slot_mapping: torch.Tensor,
    device: Union[str, torch.device, None] = None,
    max_query_len: Optional[int] = None,
    max_seq_len: Optional[int] = None,
    num_splits: Optional[int] = None,
) -> TritonAttentionMetadata:
    """Same inputs as the torch backend's ``build_attention_metadata`` (host arrays), moved to ``device``.
    max_query_len / max_seq_len are computed on the host when not given (pass them from
    ModelInputs to avoid it)."""
    device = torch.device(device) if device is not None else slot_mapping.device
    if max_query_len is None or max_seq_len is None:
        qsl = np.asarray(query_start_loc.cpu() if torch.is_tensor(query_start_loc) else query_start_loc)
        sl = np.asarray(seq_lens.cpu() if torch.is_tensor(seq_lens) else seq_lens)
        max_query_len = int(np.diff(qsl).max()) if len(sl) else 0
        max_seq_len = int(sl.max()) if len(sl) else 0
    bt = _as_tensor(block_table, torch.int32, device)
    if bt.dim() != 2 or bt.stride(1) != 1:
        bt = bt.reshape(bt.shape[0], -1).contiguous()
    return TritonAttentionMetadata(
        slot_mapping=_as_tensor(slot_mapping, torch.int64, device),
        query_start_loc=_as_tensor(query_start_loc, torch.int32, device),
        seq_lens=_as_tensor(seq_lens, torch.int32, device),
        block_table=bt,
        block_size=int(block_size),
        max_query_len=int(max_query_len),
        max_seq_len=int(max_seq_len),
        num_splits=num_splits,
    )
