"""The step's LoRA mapping and the torch shrink / expand (punica's SGMV idea on the CPU).

Each token of a step belongs to a request, each request to an adapter slot or to none (-1).
Per wrapped linear, y += (x A_s^T) B_s^T for the tokens of each slot s, in one of two ways:
- few tokens (decode-sized steps, up to DENSE_MAX_TOKENS): every slot at once, two matmuls over
  all slots' stacked A and B, the shrink's columns of other slots masked to zero (three ops a
  layer however many adapters; the extra products are over rank-sized columns);
- more tokens: per active slot, one gather (a slice when its tokens are contiguous, as a
  prefill chunk is), two matmuls, one scatter-add (a loop over at most max_loras slots).
Never a loop over tokens. Base tokens get nothing (segments) or exact zeros (masked), so they
stay the base method's output bit for bit.

Slot layout (layers.py): A [L, SR, in], B [out, L * SR] (slot s's columns s*SR...(s+1)*SR).
"""
from __future__ import annotations

from typing import Optional, Union

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
        if self.use_triton:
            return   # the kernels read token_slots
        if len(token_slots) <= DENSE_MAX_TOKENS:
            self.dense = True
            return
        for slot in np.unique(token_slots[token_slots >= 0]).tolist():
            rows = np.nonzero(token_slots == slot)[0]
            if rows[-1] - rows[0] + 1 == len(rows):
                self.segments.append((slot, slice(int(rows[0]), int(rows[-1]) + 1)))
            else:
                self.segments.append((slot, torch.from_numpy(rows).to(device)))

    def clear(self) -> None:
        self.active, self.dense = False, False
        self.token_slots: Optional[torch.Tensor] = None          # [T] int32, -1: base
        self.segments: list[tuple[int, Union[slice, torch.Tensor]]] = []
        self._masks: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}

    def mask(self, num_slots: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, num_slots * cols]: 1 where the column belongs to the token's slot (made once a
        step per layer shape)."""
        key = (num_slots, cols, dtype)
        if key not in self._masks:
            own = self.token_slots.long()[:, None] == torch.arange(num_slots, device=self.token_slots.device)
            self._masks[key] = own.to(dtype).repeat_interleave(cols, dim=1)
        return self._masks[key]


def add_lora_torch(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   mapping: LoRAMapping) -> None:
    """y [T, out] += each token's (x A[slot]^T) B[slot]^T, in place. lora_a [L, SR, in],
    lora_b [out, L * SR]."""
    L, SR, _ = lora_a.shape
    if mapping.dense:
        h = (x @ lora_a.view(L * SR, -1).t()) * mapping.mask(L, SR, x.dtype)     # [T, L * SR]
        y += h @ lora_b.t()
        return
    for slot, rows in mapping.segments:
        a, b = lora_a[slot], lora_b[:, slot * SR:(slot + 1) * SR]
        if isinstance(rows, slice):
            y[rows] += (x[rows] @ a.t()) @ b.t()
        else:
            y.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())
