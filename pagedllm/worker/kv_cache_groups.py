"""The runner's side of KV cache groups (core/kv_cache_utils.py): the layout from the layers'
specs, which cache tensor and which group's block table each attention layer uses, and one
metadata per group (a recurrent-state group's: worker/state_cache.py).

With one group nothing here runs: every layer has its own tensors and the step has one
metadata, as before groups. With several (Gemma 3), layer i reads and writes cache tensor
`tensor_of_layer[i]` (shared with the same slot of every other group: a block id is one
group's at a time) through its group's block table, so the forward context carries a list
of metadata, one per group, and `Attention.forward` picks its own.
"""

from __future__ import annotations

from torch import nn

from pagedllm.attention.kv_cache_spec import KVCacheSpec
from pagedllm.attention.layer import attention_layers
from pagedllm.core.kv_cache_utils import KVCacheConfig, kv_cache_config_from_windows
from pagedllm.models.layers.mamba.state_layer import StateMetadata


def kv_cache_config_of_specs(specs: list[KVCacheSpec], pipeline_stage: bool) -> KVCacheConfig:
    """The layout from the layers' specs (each layer's, in layer order): their sliding windows
    (None: full attention) group them. pipeline_stage: this rank holds a stage of a split model,
    which keeps one group (core/kv_cache_utils.merge_stage_configs joins the stages)."""
    return kv_cache_config_from_windows(
        [getattr(spec, "sliding_window", None) for spec in specs], one_group=pipeline_stage
    )


def assign_kv_cache_groups(model: nn.Module, config: KVCacheConfig, specs: list[KVCacheSpec]) -> list[KVCacheSpec]:
    """Tell each attention layer its group and tensor -> the spec of each shared tensor (what
    the runner allocates and sizes blocks by). specs: each layer's, in layer order."""
    pages = {spec.page_size_bytes for spec in specs}
    if len(pages) != 1:
        raise RuntimeError(f"KV cache groups need one page size for every layer, got {sorted(pages)}")
    tensor_specs: list = [None] * config.num_tensors
    for i, (layer, group) in enumerate(zip(attention_layers(model).values(), config.group_of_layer())):
        layer.kv_cache_group_id = group
        layer.kv_cache_tensor_id = config.tensor_of_layer[i]
        tensor_specs[layer.kv_cache_tensor_id] = tensor_specs[layer.kv_cache_tensor_id] or specs[i]
    return tensor_specs


def build_step_metadata(backend, inputs, block_size: int, config: KVCacheConfig, device, bidirectional=None):
    """The step's metadata of every group, from its own block table and slot mapping: the
    backend's for an attention group, a StateMetadata for a recurrent-state group. One group:
    its metadata alone; several: a list, one per group. bidirectional: the step's image spans
    that attend both ways (worker/bidirectional.py), for every attention group."""
    extra = {} if bidirectional is None else {"bidirectional": bidirectional}
    tables = [inputs.block_table, *inputs.group_block_tables]
    slots = [inputs.slot_mapping, *inputs.group_slot_mappings]
    metas = [
        StateMetadata.build(inputs.query_start_loc, inputs.num_computed_tokens, table, device, group.state_blocks)
        if group.state_blocks is not None
        else backend.build_metadata(
            inputs.query_start_loc,
            inputs.seq_lens,
            table,
            slot,
            block_size,
            inputs.max_query_len,
            inputs.max_seq_len,
            **extra,
        )
        for group, table, slot in zip(config.kv_cache_groups, tables, slots)
    ]
    return metas[0] if len(metas) == 1 else metas
