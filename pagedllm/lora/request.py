"""LoRARequest: which adapter a request runs with (vLLM's lora/request.py names)."""

from __future__ import annotations

import msgspec


def count_adapters(requests) -> dict[str, int]:
    """Adapter name -> how many of `requests` (pagedllm.request.Request) run with it."""
    counts: dict[str, int] = {}
    for r in requests:
        if r.lora_request is not None:
            counts[r.lora_request.lora_name] = counts.get(r.lora_request.lora_name, 0) + 1
    return counts


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """lora_name: the name users pick it by (the server's `model`); lora_int_id: a unique id
    >= 1 (the prefix cache keys blocks by it, the worker its slot); lora_path: a PEFT adapter
    directory (adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if not self.lora_path:
            raise ValueError(f"lora_path of adapter {self.lora_name!r} must name a PEFT adapter directory")
