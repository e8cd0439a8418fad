"""KV cache groups (vLLM v1's KVCacheConfig / KVCacheGroupSpec, its hybrid allocator's layout).

Layers that keep the same kind of cache (full attention, or one sliding window) form groups;
each group has its own block table per request and its own manager
(core/single_type_kv_cache_manager.py), all over one BlockPool. So that a block freed by a
sliding group can hold a full group's tokens, a block id names the same memory in every group:
the groups have `group_size` layers each (the smallest kind's layer count; larger kinds are
split into several groups of that size, the last maybe smaller) and the i-th layer of every
group shares cache tensor i. A block then costs group_size layers' pages, not every layer's.

Gemma 3 270M (15 local, 3 global layers): 6 groups of 3 layers over 3 tensors; a long request
holds all its blocks in the global group and about window / block_size in each local one.

Torch-free: the engine core, the frontend's admission check and the runner all derive the same
layout from config.json's per-layer windows (`kv_cache_config_of`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers (indices into the model's attention layers) that share one block table."""
    layer_ids: tuple[int, ...]
    sliding_window: Optional[int]   # None: full attention

    def max_num_blocks(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """The most blocks a request of num_tokens tokens holds in this group at once, prefilled
        in chunks of at most max_chunk tokens: a sliding group keeps only the blocks of
        (computed - W, computed + chunk] (whole blocks, so one more at the edges)."""
        full = cdiv(num_tokens, block_size)
        if self.sliding_window is None:
            return full
        return min(full, cdiv(self.sliding_window - 1 + max_chunk, block_size) + 1)


@dataclass(frozen=True)
class KVCacheConfig:
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    num_tensors: int                  # cache tensors (K, V) the runner allocates
    tensor_of_layer: tuple[int, ...]  # which of them each attention layer reads and writes

    @property
    def is_hybrid(self) -> bool:
        return len(self.kv_cache_groups) > 1

    def group_of_layer(self) -> list[int]:
        out = [0] * len(self.tensor_of_layer)
        for g, group in enumerate(self.kv_cache_groups):
            for i in group.layer_ids:
                out[i] = g
        return out

    def max_num_blocks(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """Worst-case blocks of one request of num_tokens tokens, every group together."""
        return sum(g.max_num_blocks(num_tokens, block_size, max_chunk) for g in self.kv_cache_groups)


def make_kv_cache_config(layer_windows: Sequence[Optional[int]]) -> KVCacheConfig:
    """Groups from each layer's sliding window (None: full attention). One kind of layer: one
    group of every layer, one tensor per layer (the layout before groups existed)."""
    n = len(layer_windows)
    kinds = list(dict.fromkeys(layer_windows))   # in order of first appearance
    if len(kinds) <= 1:
        return KVCacheConfig((KVCacheGroupSpec(tuple(range(n)), kinds[0] if kinds else None),),
                             num_tensors=n, tensor_of_layer=tuple(range(n)))
    kinds.sort(key=lambda w: (w is not None, w or 0))   # full attention first, then by window
    by_kind = {w: [i for i, lw in enumerate(layer_windows) if lw == w] for w in kinds}
    group_size = min(len(ids) for ids in by_kind.values())
    groups, tensor_of_layer = [], [0] * n
    for w in kinds:
        ids = by_kind[w]
        for start in range(0, len(ids), group_size):
            chunk = tuple(ids[start:start + group_size])
            groups.append(KVCacheGroupSpec(chunk, w))
            for slot, layer in enumerate(chunk):
                tensor_of_layer[layer] = slot
    return KVCacheConfig(tuple(groups), num_tensors=group_size, tensor_of_layer=tuple(tensor_of_layer))


def kv_cache_config_of(hf_config: dict, pipeline_parallel_size: int = 1) -> KVCacheConfig:
    """The model's layout from config.json. A pipeline stage holds only some layers, so a
    split model keeps one group (its sliding layers then keep every block, as before groups)."""
    from pagedllm.models.hf_config import kv_cache_sliding_window, layer_sliding_windows
    windows = layer_sliding_windows(hf_config)
    if pipeline_parallel_size > 1:
        windows = [kv_cache_sliding_window(hf_config)] * len(windows)
    return make_kv_cache_config(windows)
