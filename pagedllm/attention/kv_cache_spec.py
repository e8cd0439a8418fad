"""What one layer keeps in the KV cache, declared by the layer (vLLM v1's KVCacheSpec): the
runner sizes and allocates the cache from these, so a layer of another kind (sliding window,
latent/MLA) declares its own spec instead of the runner assuming full attention."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagedllm.attention.kv_quant import SCALE_DTYPE, is_quantized


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of this layer takes."""
        raise NotImplementedError

    def kv_shapes(self, num_blocks: int) -> list[tuple[int, ...]]:
        """The shapes of this layer's cache tensors for num_blocks blocks."""
        raise NotImplementedError

    def kv_tensors(self, num_blocks: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of each of this layer's cache tensors for num_blocks blocks."""
        return [(shape, self.dtype) for shape in self.kv_shapes(num_blocks)]


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """K and V of every token: two tensors [num_blocks * block_size, num_kv_heads, head_size]
    (a flat slot axis: slot = block_id * block_size + offset). A quantized dtype (int8, fp8:
    attention/kv_quant.py) adds their scales, [num_blocks * block_size, num_kv_heads] float32
    each: (K, V, K_scale, V_scale)."""

    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        return sum(math.prod(shape) * torch.empty((), dtype=dt).element_size() for shape, dt in self.kv_tensors(1))

    def kv_shapes(self, num_blocks: int) -> list[tuple[int, ...]]:
        return [(num_blocks * self.block_size, self.num_kv_heads, self.head_size)] * 2

    def kv_tensors(self, num_blocks: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        tensors = super().kv_tensors(num_blocks)
        if is_quantized(self.dtype):
            tensors += [((num_blocks * self.block_size, self.num_kv_heads), SCALE_DTYPE)] * 2
        return tensors


@dataclass(frozen=True)
class MLAAttentionSpec(KVCacheSpec):
    """Multi-head latent attention (DeepSeek-V2/V3): per token only the compressed latent c_kv
    [kv_lora_rank] and the decoupled RoPE key k_pe [qk_rope_head_dim], shared by every head;
    one tensor [num_blocks * block_size, kv_lora_rank + qk_rope_head_dim]."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.block_size * (self.kv_lora_rank + self.qk_rope_head_dim) * elem

    def kv_shapes(self, num_blocks: int) -> list[tuple[int, ...]]:
        return [(num_blocks * self.block_size, self.kv_lora_rank + self.qk_rope_head_dim)]


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """A sliding-window layer: each query attends to the last `sliding_window` tokens only (its
    own included). Same tensors as full attention; the KV cache manager may free a request's
    blocks that fall wholly before every future query's window (when every layer slides)."""

    sliding_window: int = 0


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """A recurrent layer (Mamba2, LFM2's short convolution, Gated DeltaNet; vLLM v1's MambaSpec):
    a fixed-size state per request, whatever its length: `shapes` are one request's state
    tensors of this layer (say conv (conv_dim, kernel - 1) and SSM (heads, head_dim, d_state)).
    Its group holds a fixed number of blocks per request (`blocks_per_request`), taken from
    the same pool as attention blocks, so admission counts the bytes the state will hold."""

    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype

    @property
    def state_bytes(self) -> int:
        """Bytes of one request's state in this layer."""
        return sum(math.prod(shape) for shape in self.shapes) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def page_size_bytes(self) -> int:
        return self.state_bytes

    def blocks_per_request(self, page_size_bytes: int) -> int:
        """Blocks of page_size_bytes (the attention layers' page) one request's state takes."""
        if page_size_bytes <= 0:
            raise ValueError(f"page_size_bytes must be > 0, got {page_size_bytes}")
        return -(self.state_bytes // -page_size_bytes)

    def kv_shapes(self, num_blocks: int) -> list[tuple[int, ...]]:
        return [(num_blocks, *shape) for shape in self.shapes]
