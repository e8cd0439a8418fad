"""Multi-LoRA serving (vLLM's lora/): adapters in PEFT's format, served many to a batch.

request.py (LoRARequest), peft_helper.py (an adapter directory checked against the model),
lora_model.py (its tensors, scaled and keyed by our fused layers), layers.py (LoRALinearMethod:
a layer's base method plus the batch's adapter deltas), punica.py (the step's token -> slot
mapping and the torch shrink / expand), triton_ops.py (the same on the GPU),
worker_manager.py (the slots, the host cache, LRU).
"""

from pagedllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
