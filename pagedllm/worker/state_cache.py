"""The runner's side of recurrent state (core/state_kv_cache_manager.py is the scheduler's):
the KV cache layout of a model with recurrent layers, and each such layer's state tensors as
views of the cache pages.

- a model of recurrent layers only (Mamba2): one state group of every layer; tensor i is
  layer i's state tensors themselves, [num_blocks, *shape] each; a request holds one block;
- a hybrid (LFM2): the attention layout plus state groups over the same tensor slots
  (core/kv_cache_utils.add_state_groups). Block b of a slot is row b of its K and of its V
  ([num_blocks, block_size * heads * head_dim] each). A state layer whose state tensors fit
  those rows of one block (first fit) sees them as [num_blocks, *shape] strided views; a
  larger state is laid over the rows of several blocks (models/layers/mamba/state_pages.py,
  vLLM instead raises the attention block size), and every request holds that many blocks in
  each state group (the most any recurrent layer needs).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedllm.attention.kv_cache_spec import KVCacheSpec
from pagedllm.attention.kv_quant import is_quantized
from pagedllm.core.kv_cache_utils import KVCacheConfig, KVCacheGroupSpec, add_state_groups
from pagedllm.models.layers.mamba.state_layer import state_layers
from pagedllm.models.layers.mamba.state_pages import StatePages, blocks_needed
from pagedllm.worker.kv_cache_groups import assign_kv_cache_groups, kv_cache_config_of_specs


def _placement(row_elems: list[int], shapes) -> list[tuple[int, int]] | None:
    """(row, offset) of each state tensor in rows of row_elems elements (first fit, largest
    first); None when they do not fit."""
    free, out = list(row_elems), [None] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: -math.prod(shapes[i])):
        n = math.prod(shapes[i])
        row = next((r for r, f in enumerate(free) if f >= n), None)
        if row is None:
            return None
        out[i] = (row, row_elems[row] - free[row])
        free[row] -= n
    return out


def _row_elems(spec: KVCacheSpec) -> list[int]:
    """Elements of one block in each of an attention spec's tensors."""
    return [math.prod(shape) for shape, _ in spec.kv_tensors(1)]


def state_kv_cache_layout(
    model: nn.Module, attn_specs: list[KVCacheSpec], block_size: int, dtype: torch.dtype
) -> tuple[KVCacheConfig, list[KVCacheSpec]]:
    """(layout, the spec of each shared tensor) of a model with recurrent layers (attn_specs:
    its attention layers', in layer order); every layer learns its group and tensor."""
    if is_quantized(dtype):
        raise ValueError(
            "kv_cache_dtype must be 'auto' for a model with recurrent layers: their state is kept "
            "in the KV cache's dtype, and a quantized one would lose it"
        )
    layers = list(state_layers(model).values())
    specs = [layer.get_kv_cache_spec(block_size, dtype) for layer in layers]
    n = len(layers)
    if not attn_specs:
        config = KVCacheConfig((KVCacheGroupSpec(tuple(range(n)), None, 1),), n, tuple(range(n)))
        tensor_specs = list(specs)
    else:
        rows = _row_elems(attn_specs[0])
        state_blocks = max(_blocks_of(rows, spec.shapes) for spec in specs)
        config = add_state_groups(kv_cache_config_of_specs(attn_specs, False), n, state_blocks)
        tensor_specs = assign_kv_cache_groups(model, config, attn_specs)
    first = len(config.tensor_of_layer) - n
    groups = config.group_of_layer()
    for i, layer in enumerate(layers):
        layer.kv_cache_group_id, layer.kv_cache_tensor_id = groups[first + i], config.tensor_of_layer[first + i]
    return config, tensor_specs


def _blocks_of(row_elems: list[int], shapes) -> int:
    """Blocks one request's state takes: 1 where its tensors fit one page's rows whole, else
    as many as hold them laid end to end."""
    return 1 if _placement(row_elems, shapes) is not None else blocks_needed(row_elems, shapes)


def bind_state_cache(model: nn.Module, kv_caches: list[tuple[torch.Tensor, ...]], num_blocks: int) -> None:
    """Give each recurrent layer its state tensors, [num_blocks, *shape] views of its shared
    tensor's cache, or the pages of several blocks its state is spread over ([] unbinds)."""
    for layer in state_layers(model).values():
        layer.state = layer.pages = None
        if not kv_caches:
            continue
        slot = kv_caches[layer.kv_cache_tensor_id]
        shapes = layer.state_shapes
        if [tuple(t.shape) for t in slot] == [(num_blocks, *s) for s in shapes]:
            layer.state = tuple(slot)  # the slot is this layer's own state tensors
            continue
        rows = [t.view(num_blocks, -1) for t in slot]  # block b's page: row b of each tensor
        where = _placement([r.shape[1] for r in rows], shapes)
        if where is None:
            layer.pages = StatePages(rows, shapes)
            continue
        layer.state = tuple(
            rows[r][:, off : off + math.prod(s)].view(num_blocks, *s) for (r, off), s in zip(where, shapes)
        )
