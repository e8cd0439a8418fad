"""Attention: the model's attention op over the paged KV cache (vLLM's / nano-vllm's
layers/attention.py).

A model computes q, k, v and calls `Attention.forward(q, k, v)`; the layer owns its view of
the KV cache (bound once by the runner: `bind_kv_cache`), reads the step's metadata from the
forward context, and calls the backend it was built with (attention/selector.py). It also
declares what it keeps in the cache (`get_kv_cache_spec`), from which the runner sizes and
allocates the cache.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagedllm.attention.backends.abstract import AttentionBackend
from pagedllm.attention.kv_cache_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from pagedllm.attention.selector import get_current_attn_backend
from pagedllm.forward_context import get_group_metadata


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        backend: Optional[AttentionBackend] = None,
        sliding_window: Optional[int] = None,
    ) -> None:
        """sliding_window: each query attends to its last `sliding_window` tokens only (None: all)."""
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.backend = backend if backend is not None else get_current_attn_backend()
        if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
            raise ValueError(f"sliding_window must be an integer >= 1, got {sliding_window!r}")
        if sliding_window is not None and not self.backend.supports_sliding_window:
            raise ValueError(
                f"the {self.backend.name} attention backend does not run sliding-window "
                f"layers; use --attention-backend torch"
            )
        self.sliding_window = sliding_window
        # (K, V), each [num_blocks * block_size, num_kv_heads, head_dim]: views of the runner's cache
        self.kv_cache: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        # Several KV cache groups (worker/kv_cache_groups.py): this layer's group (whose
        # metadata it reads) and the shared cache tensor it uses; None: its own tensor.
        self.kv_cache_group_id = 0
        self.kv_cache_tensor_id: Optional[int] = None

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        if self.sliding_window is not None:
            return SlidingWindowSpec(block_size, self.num_kv_heads, self.head_dim, dtype, self.sliding_window)
        return FullAttentionSpec(block_size, self.num_kv_heads, self.head_dim, dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] (this step's, rotated) -> out [T, H, D]; k/v are written
        into this layer's cache at the step's slot_mapping."""
        if self.kv_cache is None:
            raise RuntimeError(
                "this Attention layer has no KV cache: the runner binds it "
                "(attention.layer.bind_kv_cache) once the cache is allocated"
            )
        return self.backend.forward(self, q, k, v, self.kv_cache, get_group_metadata(self.kv_cache_group_id))

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, sliding_window={self.sliding_window}, backend={self.backend.name}"
        )


def attention_layers(model: nn.Module) -> dict[str, Attention]:
    """The model's Attention layers by module name, in layer order (a pipeline stage: its own)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, Attention)}


def get_kv_cache_spec(model: nn.Module, block_size: int, dtype: torch.dtype) -> dict[str, KVCacheSpec]:
    """What each attention layer of the model keeps in the cache, by layer name."""
    return {name: layer.get_kv_cache_spec(block_size, dtype) for name, layer in attention_layers(model).items()}


def bind_kv_cache(model: nn.Module, kv_caches: list[tuple[torch.Tensor, ...]]) -> None:
    """Give each attention layer its cache: kv_caches[i] is the i-th layer's (K, V), in layer
    order, or with KV cache groups the i-th shared tensor pair (a layer's kv_cache_tensor_id).
    An empty list unbinds them (so that a temporary cache can be freed)."""
    layers = list(attention_layers(model).values())
    tensor_ids = [getattr(layer, "kv_cache_tensor_id", None) for layer in layers]
    if tensor_ids and tensor_ids[0] is None:
        tensor_ids = list(range(len(layers)))
    if kv_caches and layers and len(kv_caches) != max(tensor_ids) + 1:
        raise ValueError(f"{len(kv_caches)} KV caches for {len(layers)} attention layers")
    for layer, t in zip(layers, tensor_ids):
        layer.kv_cache = tuple(kv_caches[t]) if kv_caches else None
