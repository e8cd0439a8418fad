"""The worker's adapters: preallocated slots in every wrapped layer (--max-loras, of
--max-lora-rank), adapters read from disk kept in host memory (--max-cpu-loras), both LRU.

Each step, `set_active_loras` gives every adapter of the batch a slot (the scheduler never
schedules more distinct adapters than slots): one already there stays, a new one takes a free
slot or the least recently used one not in this step, copied in from the host cache (or read
from its directory first). Then it sets the step's token -> slot mapping that the wrapped
layers read.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

import numpy as np
import torch
from torch import nn

from pagedllm.lora.layers import LoRALinearMethod
from pagedllm.lora.lora_model import LoRAModel
from pagedllm.lora.punica import LoRAMapping
from pagedllm.lora.request import LoRARequest
from pagedllm.models.layers.linear import LinearBase

# Our layers an adapter can target (peft_helper.TARGETS maps PEFT's projections onto them).
LORA_MODULES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class LoRAModelManager:
    def __init__(
        self, model: nn.Module, hf: dict, max_loras: int, max_lora_rank: int, max_cpu_loras: int, device: torch.device
    ) -> None:
        self.hf, self.max_loras, self.max_rank, self.max_cpu_loras = hf, max_loras, max_lora_rank, max_cpu_loras
        self.mapping = LoRAMapping(use_triton=device.type == "cuda")
        dtype = next(model.parameters()).dtype
        self.layers: dict[str, LinearBase] = {}
        for i, decoder in enumerate(model.layers):
            for name in LORA_MODULES:
                try:
                    layer = decoder.get_submodule(name)
                except AttributeError:
                    continue  # e.g. an MoE layer's experts: no adapter can target them
                if not isinstance(layer, LinearBase):
                    continue
                layer.linear_method = LoRALinearMethod(layer.linear_method, self.mapping)
                layer.linear_method.create_lora_weights(layer, max_loras, max_lora_rank, dtype, device)
                self.layers[f"layers.{i}.{name}"] = layer
        model.lora_mapping = self.mapping  # the C++ decode loop steps aside when it is active
        self.slots: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recent first
        self.host: OrderedDict[int, LoRAModel] = OrderedDict()

    def _host_model(self, lora: LoRARequest) -> LoRAModel:
        model = self.host.get(lora.lora_int_id)
        if model is None:
            model = LoRAModel.from_local_checkpoint(lora, self.hf, self.max_rank)
            self.host[lora.lora_int_id] = model
            while len(self.host) > self.max_cpu_loras:
                self.host.popitem(last=False)
        self.host.move_to_end(lora.lora_int_id)
        return model

    def _activate(self, lora: LoRARequest, busy: set[int]) -> int:
        """lora's slot, loading it into a free or the least recently used idle slot."""
        if lora.lora_int_id in self.slots:
            self.slots.move_to_end(lora.lora_int_id)
            return self.slots[lora.lora_int_id]
        used = set(self.slots.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next((i for i in self.slots if self.slots[i] not in busy), None)
            if victim is None:
                raise RuntimeError(f"more adapters in one step than max_loras ({self.max_loras})")
            slot = self.slots.pop(victim)
        model = self._host_model(lora)
        for name, layer in self.layers.items():
            layer.linear_method.set_lora(layer, slot, model.weights.get(name))
        self.slots[lora.lora_int_id] = slot
        return slot

    def set_active_loras(self, loras: Sequence[Optional[LoRARequest]], num_scheduled: np.ndarray) -> bool:
        """loras[i]: the adapter of the batch's row i (None: base); num_scheduled [num_reqs] its
        tokens this step. -> whether any adapter runs in this step."""
        row_slots = np.full(len(loras), -1, dtype=np.int32)
        busy: set[int] = set()
        for i, lora in enumerate(loras):
            if lora is not None:
                row_slots[i] = self._activate(lora, busy)
                busy.add(int(row_slots[i]))
        if not busy:
            self.mapping.clear()
            return False
        self.mapping.set(np.repeat(row_slots, num_scheduled), self.mapping_device)
        return True

    @property
    def mapping_device(self) -> torch.device:
        return next(iter(self.layers.values())).lora_a.device

    def remove(self, lora_int_id: int) -> None:
        """Forget an adapter (unloaded by the server): its slot is free, its host copy gone."""
        self.slots.pop(lora_int_id, None)
        self.host.pop(lora_int_id, None)


def make_lora_manager(model: nn.Module, config, device: torch.device) -> Optional[LoRAModelManager]:
    """The manager of a model loaded with --enable-lora, else None."""
    lc = config.lora_config
    if lc is None:
        return None
    return LoRAModelManager(
        model, config.model_config.hf_config, lc.max_loras, lc.max_lora_rank, lc.max_cpu_loras, device
    )
