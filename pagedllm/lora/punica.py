"""The step's LoRA mapping and the torch shrink / expand (punica's SGMV idea on the CPU).

Each token of a step belongs to a request, each request to an adapter slot or to none (-1).
Per wrapped linear, y += (x A_s^T) B_s^T over the rows of each active slot s: one gather, two
matmuls and one scatter-add per slot in the step (a Python loop over at most max_loras slots,
never over tokens); rows of one slot that are contiguous are a slice (no gather). Rows with no
adapter are not touched, so they stay exactly the base method's output.
"""
from __future__ import annotations

from typing import Optional, Union

import numpy as np
import torch


class LoRAMapping:
    """Set by the worker's LoRA manager before each forward; read by every LoRALinearMethod."""

    def __init__(self, use_triton: bool = False) -> None:
        self.use_triton = use_triton
        self.active = False
        self.token_slots: Optional[torch.Tensor] = None          # [T] int32, -1: base
        self.segments: list[tuple[int, Union[slice, torch.Tensor]]] = []

    def set(self, token_slots: np.ndarray, device) -> None:
        """token_slots [T]: the slot of each token of the step, -1 for the base model."""
        self.active = bool((token_slots >= 0).any())
        if not self.active:
            self.clear()
            return
        self.token_slots = torch.from_numpy(token_slots.astype(np.int32)).to(device, non_blocking=True)
        self.segments = []
        if self.use_triton:
            return   # the kernels read token_slots
        for slot in np.unique(token_slots[token_slots >= 0]).tolist():
            rows = np.nonzero(token_slots == slot)[0]
            if rows[-1] - rows[0] + 1 == len(rows):
                self.segments.append((slot, slice(int(rows[0]), int(rows[-1]) + 1)))
            else:
                self.segments.append((slot, torch.from_numpy(rows).to(device)))

    def clear(self) -> None:
        self.active, self.token_slots, self.segments = False, None, []


def add_lora_torch(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   segments) -> None:
    """y [T, out] += per segment (slot, rows): (x[rows] A[slot]^T) B[slot]^T, in place.
    lora_a [max_loras, R, in], lora_b [max_loras, out, R]."""
    for slot, rows in segments:
        if isinstance(rows, slice):
            y[rows] += (x[rows] @ lora_a[slot].t()) @ lora_b[slot].t()
        else:
            y.index_add_(0, rows, (x.index_select(0, rows) @ lora_a[slot].t()) @ lora_b[slot].t())
