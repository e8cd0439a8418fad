"""LoRALinearMethod: a linear layer's own method (packed, plain, quantized...) plus the step's
adapter deltas. The base method is wrapped, not replaced: it computes y for every row as
before, and only rows of a request with an adapter get (x A^T) B^T added, so base rows stay
exactly the base model's.

A layer of S fused matrices (QKV: 3, gate/up: 2, else 1) holds, per slot, its S adapters'
A stacked along the rank (lora_a [L, S * R, in], R = max_rank) and their B block-diagonally
(lora_b [out, L * S * R]: slot s's columns s*S*R..., shard i's rows reading only its own R of
them): one shrink and one expand serve the fused layer, and an adapter that does not target a
shard (or has a smaller rank) leaves zeros that add nothing. On the CPU each slot is also
copied, when set, into the compute layout of punica.py (lora_a_t, lora_b_t) that the
decode-sized steps' masked form reads.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm.lora.punica import LoRAMapping, add_lora_dense, add_lora_torch, write_compute_slot
from pagedllm.models.layers.linear_method import LinearMethodBase


class LoRALinearMethod(LinearMethodBase):
    def __init__(self, base_method: LinearMethodBase, mapping: LoRAMapping) -> None:
        self.base_method = base_method
        self.mapping = mapping

    def create_weights(self, layer, input_size, output_size):
        self.base_method.create_weights(layer, input_size, output_size)

    def process_weights_after_loading(self, layer):
        self.base_method.process_weights_after_loading(layer)

    def create_lora_weights(self, layer: nn.Module, max_loras: int, max_rank: int, dtype, device) -> None:
        """The slots: layer.lora_a [max_loras, S * max_rank, in], layer.lora_b [out, max_loras * S * max_rank]."""
        slices = len(getattr(layer, "output_ranges", (None,)))
        self.max_rank, self.cols = max_rank, slices * max_rank
        layer.register_buffer(
            "lora_a", torch.zeros(max_loras, self.cols, layer.input_size, dtype=dtype, device=device), persistent=False
        )
        layer.register_buffer(
            "lora_b",
            torch.zeros(layer.output_size, max_loras * self.cols, dtype=dtype, device=device),
            persistent=False,
        )
        # (first out column, count) of each shard: where its expand writes
        self.shard_cols = (
            [(at, len(r)) for at, r in zip(layer.offsets, layer.output_ranges)]
            if hasattr(layer, "output_ranges")
            else [(0, layer.output_size)]
        )
        if torch.device(device).type == "cpu":  # the compute layout: A^T [in, S * L * R], B^T [L * R, out]
            layer.register_buffer(
                "lora_a_t",
                torch.zeros(layer.input_size, max_loras * self.cols, dtype=dtype, device=device),
                persistent=False,
            )
            layer.register_buffer(
                "lora_b_t",
                torch.zeros(max_loras * max_rank, layer.output_size, dtype=dtype, device=device),
                persistent=False,
            )

    def set_lora(
        self, layer: nn.Module, slot: int, shards: Optional[dict[int, tuple[torch.Tensor, torch.Tensor]]]
    ) -> None:
        """Slot `slot` <- an adapter's {shard: (A [r, in], B [out_whole, r])} (None: no adapter
        on this layer), cut to this rank's features as the layer cuts its weight."""
        slot_b = layer.lora_b[:, slot * self.cols : (slot + 1) * self.cols]  # [out, S * R]
        layer.lora_a[slot].zero_()
        slot_b.zero_()
        for shard, (a, b) in (shards or {}).items():
            r, col = a.shape[0], shard * self.max_rank
            in_range = getattr(layer, "input_range", range(a.shape[1]))
            layer.lora_a[slot, col : col + r].copy_(a[:, in_range.start : in_range.stop])
            if hasattr(layer, "output_ranges"):
                out, at = layer.output_ranges[shard], layer.offsets[shard]
                slot_b[at : at + len(out), col : col + r].copy_(b[out.start : out.stop])
            else:
                slot_b[:, col : col + r].copy_(b)
        if hasattr(layer, "lora_a_t"):
            write_compute_slot(layer.lora_a_t, layer.lora_b_t, layer.lora_a, layer.lora_b, slot, self.shard_cols)

    def apply(self, layer, x, bias=None):
        y = self.base_method.apply(layer, x, bias)
        m = self.mapping
        if m.active:
            if m.use_triton:
                from pagedllm.lora.triton_ops import add_lora_triton

                L = layer.lora_a.shape[0]  # B as [L, out, S * R] (strided view)
                b = layer.lora_b.view(layer.output_size, L, self.cols).permute(1, 0, 2)
                add_lora_triton(y, x, layer.lora_a, b, m.token_slots)
            elif m.dense:
                add_lora_dense(y, x, layer.lora_a_t, layer.lora_b_t, self.shard_cols, self.max_rank, m)
            else:
                add_lora_torch(y, x, layer.lora_a, layer.lora_b, m)
        return y
