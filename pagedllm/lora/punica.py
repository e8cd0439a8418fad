"""The step's LoRA mapping and the torch shrink / expand (punica's SGMV idea on the CPU).

Each token of a step belongs to a request, each request to an adapter slot or to none (-1).
Per wrapped linear, y += (x A_s^T) B_s^T for the tokens of each slot s, in one of two ways:
- few tokens (decode-sized steps, up to DENSE_MAX_TOKENS): `add_lora_dense`, every slot at
  once over the compute layout (below): one shrink over all slots' and shards' A, the columns
  of other slots masked to zero, one in-place expand (addmm_) per shard of a fused layer (S + 2
  ops a layer however many adapters; the extra products are over rank-sized columns);
- more tokens: `add_lora_torch`, per active slot one gather (a slice when its tokens are
  contiguous, as a prefill chunk is), two matmuls, one scatter-add (a loop over at most
  max_loras slots).
Never a loop over tokens. Base tokens get nothing (segments) or exact zeros (masked), so they
stay the base method's output bit for bit.

Slot layout (layers.py, what set_lora writes and the Triton kernels read): A [L, SR, in],
B [out, L * SR] (slot s's columns s*SR...(s+1)*SR), SR = S shards * R.
Compute layout (the CPU's dense form, kept beside it): A^T [in, S * L * R] shard-major (shard
i's columns i*L*R..., slot s's R of them at s*R within), B^T [L * R, out] (shard i's out
columns read only its own L * R rows): no block-diagonal zeros in the expand (S times fewer
products than one matmul over B), and both GEMMs over contiguous row-major operands.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np
import torch

DENSE_MAX_TOKENS = 128


class LoRAMapping:
    """Set by the worker's LoRA manager before each forward; read by every LoRALinearMethod."""

    def __init__(self, use_triton: bool = False) -> None:
        self.use_triton = use_triton
        self.clear()

    def set(self, token_slots: np.ndarray, device) -> None:
        """token_slots [T]: the slot of each token of the step, -1 for the base model."""
        self.clear()
        self.active = bool((token_slots >= 0).any())
        if not self.active:
            return
        self.token_slots = torch.from_numpy(token_slots.astype(np.int32)).to(device, non_blocking=True)
        self._np_slots, self._device = token_slots, device
        self.dense = not self.use_triton and len(token_slots) <= DENSE_MAX_TOKENS  # else the kernels / segments

    def clear(self) -> None:
        self.active, self.dense = False, False
        self.token_slots: Optional[torch.Tensor] = None  # [T] int32, -1: base
        self._np_slots, self._device = None, None
        self._segments: Optional[list[tuple[int, Union[slice, torch.Tensor]]]] = None
        self._masks: dict[tuple[int, int, int, torch.dtype], torch.Tensor] = {}

    @property
    def segments(self) -> list[tuple[int, Union[slice, torch.Tensor]]]:
        """(slot, its token rows) of each active slot: a slice when contiguous, else an index
        tensor (made once a step, on first use)."""
        if self._segments is None:
            self._segments = []
            slots = self._np_slots
            for slot in np.unique(slots[slots >= 0]).tolist():
                rows = np.nonzero(slots == slot)[0]
                if rows[-1] - rows[0] + 1 == len(rows):
                    self._segments.append((slot, slice(int(rows[0]), int(rows[-1]) + 1)))
                else:
                    self._segments.append((slot, torch.from_numpy(rows).to(self._device)))
        return self._segments

    def mask(self, num_slots: int, cols: int, dtype: torch.dtype, shards: int = 1) -> torch.Tensor:
        """[T, shards * num_slots * cols]: 1 where the column (shard, slot, col) belongs to the
        token's slot (made once a step per layer shape)."""
        key = (num_slots, cols, shards, dtype)
        if key not in self._masks:
            own = self.token_slots.long()[:, None] == torch.arange(num_slots, device=self.token_slots.device)
            self._masks[key] = own.to(dtype).repeat_interleave(cols, dim=1).repeat(1, shards)
        return self._masks[key]


def add_lora_torch(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, mapping: LoRAMapping
) -> None:
    """y [T, out] += each token's (x A[slot]^T) B[slot]^T, in place, per active slot over its
    rows. lora_a [L, SR, in], lora_b [out, L * SR] (the slot layout)."""
    SR = lora_a.shape[1]
    for slot, rows in mapping.segments:
        a, b = lora_a[slot], lora_b[:, slot * SR : (slot + 1) * SR]
        if isinstance(rows, slice):
            y[rows] += (x[rows] @ a.t()) @ b.t()
        else:
            y.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())


def add_lora_dense(
    y: torch.Tensor,
    x: torch.Tensor,
    a_t: torch.Tensor,
    b_t: torch.Tensor,
    shard_cols: Sequence[tuple[int, int]],
    rank: int,
    mapping: LoRAMapping,
) -> None:
    """y [T, out] += each token's delta, in place, every slot at once (the masked form). a_t
    [in, S * L * R], b_t [L * R, out] (the compute layout); shard_cols[i]: (first out column,
    count) of shard i."""
    S = len(shard_cols)
    LR = a_t.shape[1] // S
    h = torch.mm(x, a_t).mul_(mapping.mask(LR // rank, rank, x.dtype, S))  # [T, S * L * R]
    if S == 1:
        y.addmm_(h, b_t)
        return
    for i, (at, n) in enumerate(shard_cols):
        y[:, at : at + n].addmm_(h[:, i * LR : (i + 1) * LR], b_t[:, at : at + n])


def write_compute_slot(
    a_t: torch.Tensor,
    b_t: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slot: int,
    shard_cols: Sequence[tuple[int, int]],
) -> None:
    """Copy slot `slot` of the slot layout (lora_a [L, S * R, in], lora_b [out, L * S * R]) into
    the compute layout (a_t [in, S * L * R], b_t [L * R, out])."""
    L, SR, n_in = lora_a.shape
    S = len(shard_cols)
    R = SR // S
    a_t.view(n_in, S, L, R)[:, :, slot].copy_(lora_a[slot].view(S, R, n_in).permute(2, 0, 1))
    slot_b = lora_b[:, slot * SR : (slot + 1) * SR]  # [out, S * R]
    for i, (at, n) in enumerate(shard_cols):
        b_t[slot * R : (slot + 1) * R, at : at + n].copy_(slot_b[at : at + n, i * R : (i + 1) * R].t())
