"""A recurrent layer's share of the KV cache (the state counterpart of attention/layer.py's
Attention): what it declares (a MambaSpec: one request's state tensors), the views of the
cache it is bound to, and the step's metadata it reads from the forward context.

Each request holds one block in the layer's state group (worker/kv_cache_groups.py sizes the
pages so that a whole state fits one block), so request r's state in this layer is row
`state_indices[r]` of every state tensor: views of the cache pages, read and written in place
each step. A request's first chunk (nothing computed yet: a new request, or one preempted
and recomputed) starts from a zero state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from pagedllm.attention.kv_cache_spec import MambaSpec
from pagedllm.forward_context import get_group_metadata


@dataclass
class StateMetadata:
    """One state group's metadata for a step (R requests, T tokens packed)."""
    query_start_loc: torch.Tensor   # [R + 1] int64: request r's tokens are [qsl[r], qsl[r + 1])
    state_indices: torch.Tensor     # [R] int64: the block holding request r's state in this group
    fresh_indices: torch.Tensor     # [F] int64: blocks of the requests whose state starts at zero
    starts: list[int]               # host copies of query_start_loc and state_indices, for the
    blocks: list[int]               # per-request prefill loop
    all_decode: bool                # every request computes one token

    @classmethod
    def build(cls, query_start_loc: torch.Tensor, num_computed_tokens: torch.Tensor,
              block_table: torch.Tensor, device) -> "StateMetadata":
        """query_start_loc [R + 1], num_computed_tokens [R] (before the step), block_table [R, *]
        of the state group (its first column: the request's one state block)."""
        qsl = query_start_loc.to(torch.int64)
        idx = block_table[:, 0].to(torch.int64)
        fresh = idx[num_computed_tokens == 0]
        starts = qsl.tolist()
        all_decode = all(b - a == 1 for a, b in zip(starts, starts[1:]))
        return cls(qsl.to(device), idx.to(device), fresh.to(device), starts, idx.tolist(), all_decode)


class StateLayer(nn.Module):
    """Base of the recurrent layers: a subclass sets `state_shapes` (one request's state
    tensors, say conv (channels, K - 1) and SSM (heads, head_dim, d_state)) and calls
    `step_state()` in its forward."""
    state_shapes: tuple[tuple[int, ...], ...] = ()

    def __init__(self) -> None:
        super().__init__()
        # One tensor per state shape, [num_blocks, *shape]: views of the runner's cache.
        self.state: Optional[tuple[torch.Tensor, ...]] = None
        self.kv_cache_group_id = 0
        self.kv_cache_tensor_id = 0

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> MambaSpec:
        return MambaSpec(block_size, tuple(self.state_shapes), dtype)

    def step_state(self) -> tuple[StateMetadata, tuple[torch.Tensor, ...]]:
        """The step's metadata of this layer's group and its state tensors, the rows of the
        requests that start here zeroed."""
        if self.state is None:
            raise RuntimeError("this recurrent layer has no state cache: the runner binds it "
                               "(worker/kv_cache_groups.bind_state_cache) once the cache is allocated")
        meta = get_group_metadata(self.kv_cache_group_id)
        if meta.fresh_indices.numel():
            for s in self.state:
                s[meta.fresh_indices] = 0
        return meta, self.state


def state_layers(model: nn.Module) -> dict[str, StateLayer]:
    """The model's recurrent layers by module name, in layer order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, StateLayer)}
