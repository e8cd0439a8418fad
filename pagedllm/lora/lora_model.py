"""LoRAModel: an adapter's weights, read from its safetensors, keyed by the model's fused
layers: B is scaled once here (y += x A^T (s B)^T, the same product as PEFT's s * B(A(x)))."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors import safe_open

from pagedllm.lora.peft_helper import TARGETS, WEIGHTS_NAME, PEFTHelper
from pagedllm.lora.request import LoRARequest


@dataclass
class LoRAModel:
    lora_int_id: int
    rank: int
    # "layers.{i}.{module}" -> {shard index: (A [r, in], s * B [out, r])}, whole base matrices
    weights: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]

    @classmethod
    def from_local_checkpoint(cls, lora: LoRARequest, hf: dict, max_lora_rank: int) -> "LoRAModel":
        helper = PEFTHelper.from_local_dir(lora.lora_path, hf, max_lora_rank)
        weights: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        with safe_open(f"{helper.path}/{WEIGHTS_NAME}", framework="pt") as f:
            for (layer, proj), (ka, kb) in helper.keys.items():
                module, shard = TARGETS[proj]
                a = f.get_tensor(ka).float()
                b = f.get_tensor(kb).float() * helper.scaling
                weights.setdefault(f"layers.{layer}.{module}", {})[shard] = (a, b)
        return cls(lora.lora_int_id, helper.r, weights)
