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

Computed once, from the layers: the worker builds the model, reads each attention layer's
KVCacheSpec (attention/kv_cache_spec.py) and makes the layout here (`kv_cache_config_from_windows`);
the executor hands it to the engine core, which gives it to the KV cache manager and, with the
block count, to the frontend's admission check. Torch-free (the frontend and the core read it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers (indices into the model's cache-holding layers) that share one block table."""

    layer_ids: tuple[int, ...]
    sliding_window: Optional[int]  # None: full attention
    # A recurrent-state group (attention/kv_cache_spec.MambaSpec): every request holds this
    # many blocks, whatever its length; None: an attention group.
    state_blocks: Optional[int] = None

    def max_num_blocks(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """The most blocks a request of num_tokens tokens holds in this group at once, prefilled
        in chunks of at most max_chunk tokens: a sliding group keeps only the blocks of
        (computed - W, computed + chunk] (whole blocks, so one more at the edges)."""
        if self.state_blocks is not None:
            return self.state_blocks
        full = cdiv(num_tokens, block_size)
        if self.sliding_window is None:
            return full
        return min(full, cdiv(self.sliding_window - 1 + max_chunk, block_size) + 1)


@dataclass(frozen=True)
class KVCacheConfig:
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    num_tensors: int  # cache tensors (K, V) the runner allocates
    tensor_of_layer: tuple[int, ...]  # which of them each attention layer reads and writes

    @property
    def is_hybrid(self) -> bool:
        return len(self.kv_cache_groups) > 1

    @property
    def has_state(self) -> bool:
        """Some layers keep a recurrent state (a hybrid or linear-attention model)."""
        return any(g.state_blocks is not None for g in self.kv_cache_groups)

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
    kinds = list(dict.fromkeys(layer_windows))  # in order of first appearance
    if len(kinds) <= 1:
        return KVCacheConfig(
            (KVCacheGroupSpec(tuple(range(n)), kinds[0] if kinds else None),),
            num_tensors=n,
            tensor_of_layer=tuple(range(n)),
        )
    kinds.sort(key=lambda w: (w is not None, w or 0))  # full attention first, then by window
    by_kind = {w: [i for i, lw in enumerate(layer_windows) if lw == w] for w in kinds}
    group_size = min(len(ids) for ids in by_kind.values())
    groups, tensor_of_layer = [], [0] * n
    for w in kinds:
        ids = by_kind[w]
        for start in range(0, len(ids), group_size):
            chunk = tuple(ids[start : start + group_size])
            groups.append(KVCacheGroupSpec(chunk, w))
            for slot, layer in enumerate(chunk):
                tensor_of_layer[layer] = slot
    return KVCacheConfig(tuple(groups), num_tensors=group_size, tensor_of_layer=tuple(tensor_of_layer))


def add_state_groups(config: KVCacheConfig, num_state_layers: int, state_blocks: int) -> KVCacheConfig:
    """The attention layout `config` plus num_state_layers recurrent layers (numbered after the
    attention layers), each request holding state_blocks blocks in every state group. The state
    layers form groups of the attention groups' size, sharing their tensor slots, so a block
    freed by one kind can hold the other's."""
    if num_state_layers <= 0 or state_blocks <= 0:
        raise ValueError(f"num_state_layers and state_blocks must be > 0, got {num_state_layers}, {state_blocks}")
    size = config.num_tensors
    first = len(config.tensor_of_layer)
    groups, tensor_of_layer = list(config.kv_cache_groups), list(config.tensor_of_layer)
    for start in range(0, num_state_layers, size):
        chunk = tuple(range(first + start, first + min(start + size, num_state_layers)))
        groups.append(KVCacheGroupSpec(chunk, None, state_blocks))
        tensor_of_layer += range(len(chunk))
    return KVCacheConfig(tuple(groups), num_tensors=size, tensor_of_layer=tuple(tensor_of_layer))


def kv_cache_config_from_windows(layer_windows: Sequence[Optional[int]], one_group: bool = False) -> KVCacheConfig:
    """The layout of layers with these sliding windows (None: full attention). one_group: a
    pipeline stage, which holds only some of the model's layers, keeps one group (its sliding
    layers then keep every block, as before groups; merge_stage_configs joins the stages)."""
    if one_group:
        kinds = set(layer_windows)
        layer_windows = [kinds.pop() if len(kinds) == 1 else None] * len(layer_windows)
    return make_kv_cache_config(layer_windows)


def merge_stage_configs(configs: Sequence[KVCacheConfig]) -> KVCacheConfig:
    """The layout the scheduler keeps for the ranks' layouts (rank 0's first). Tensor-parallel
    ranks hold the same layers: one layout. Pipeline stages keep one group each, over one block
    table that may drop blocks behind a window only when every stage's layers slide by it; the
    scheduler reads the groups' windows only, so the layer ids stay rank 0's."""
    if all(c == configs[0] for c in configs):
        return configs[0]
    if any(c.is_hybrid for c in configs):
        raise ValueError(f"ranks with different KV cache layouts must keep one group each, got {list(configs)}")
    windows = {c.kv_cache_groups[0].sliding_window for c in configs}
    group = KVCacheGroupSpec(configs[0].kv_cache_groups[0].layer_ids, windows.pop() if len(windows) == 1 else None)
    return replace(configs[0], kv_cache_groups=(group,))
