"""A recurrent layer's share of the KV cache (the state counterpart of attention/layer.py's
Attention): what it declares (a MambaSpec: one request's state tensors), the views of the
cache it is bound to, and the step's metadata it reads from the forward context.

Where a layer's whole state fits one block's page, request r's state in this layer is row
`state_indices[r]` (its first block in the group) of every state tensor: views of the cache
pages, read and written in place each step. A state larger than a page is spread over the
request's blocks in the group (`StatePages`, models/layers/mamba/state_pages.py): gathered and
scattered back. The layers go through `load_state` / `store_state` / `request_state`, which
do either. A request's first chunk (nothing computed yet: a new request, or one preempted and
recomputed) starts from a zero state.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import nn

from pagedllm.attention.kv_cache_spec import MambaSpec
from pagedllm.forward_context import get_group_metadata
from pagedllm.models.layers.mamba.state_pages import StatePages


@dataclass
class StateMetadata:
    """One state group's metadata for a step (R requests, T tokens packed)."""

    query_start_loc: torch.Tensor  # [R + 1] int64: request r's tokens are [qsl[r], qsl[r + 1])
    state_indices: torch.Tensor  # [R] int64: request r's first block in this group (a state
    # that fits one page lives there)
    fresh_indices: torch.Tensor  # [F] int64: first blocks of the requests whose state starts at zero
    starts: list[int]  # host copies of query_start_loc and state_indices, for the
    blocks: list[int]  # per-request prefill loop
    all_decode: bool  # every request computes one token
    state_blocks: torch.Tensor  # [R, n] int64: every block of request r in this group
    fresh_blocks: torch.Tensor  # [F, n] int64: those of the requests whose state starts at zero

    @classmethod
    def build(
        cls,
        query_start_loc: torch.Tensor,
        num_computed_tokens: torch.Tensor,
        block_table: torch.Tensor,
        device,
        num_blocks: int = 1,
    ) -> "StateMetadata":
        """query_start_loc [R + 1], num_computed_tokens [R] (before the step), block_table [R, *]
        of the state group (its first num_blocks columns: the request's state blocks)."""
        qsl = query_start_loc.to(torch.int64)
        table = block_table[:, :num_blocks].to(torch.int64)
        fresh = table[num_computed_tokens == 0]
        starts = qsl.tolist()
        all_decode = all(b - a == 1 for a, b in zip(starts, starts[1:]))
        table, fresh = table.to(device), fresh.to(device)
        return cls(qsl.to(device), table[:, 0], fresh[:, 0], starts, table[:, 0].tolist(), all_decode, table, fresh)


class StateLayer(nn.Module):
    """Base of the recurrent layers: a subclass sets `state_shapes` (one request's state
    tensors, say conv (channels, K - 1) and SSM (heads, head_dim, d_state)) and calls
    `step_state()` in its forward."""

    state_shapes: tuple[tuple[int, ...], ...] = ()

    def __init__(self) -> None:
        super().__init__()
        # One tensor per state shape, [num_blocks, *shape]: views of the runner's cache; or,
        # for a state larger than one block's page, the pages it is spread over.
        self.state: Optional[tuple[torch.Tensor, ...]] = None
        self.pages: Optional[StatePages] = None
        self.kv_cache_group_id = 0
        self.kv_cache_tensor_id = 0

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> MambaSpec:
        return MambaSpec(block_size, tuple(self.state_shapes), dtype)

    def step_state(self) -> StateMetadata:
        """The step's metadata of this layer's group, the states of the requests that start
        here zeroed."""
        if self.state is None and self.pages is None:
            raise RuntimeError(
                "this recurrent layer has no state cache: the runner binds it "
                "(worker/state_cache.bind_state_cache) once the cache is allocated"
            )
        meta = get_group_metadata(self.kv_cache_group_id)
        if meta.fresh_indices.numel():
            if self.pages is not None:
                self.pages.zero(meta.fresh_blocks)
            else:
                for s in self.state:
                    s[meta.fresh_indices] = 0
        return meta

    def load_state(self, meta: StateMetadata, i: int) -> torch.Tensor:
        """State tensor i of every request of the step -> [R, *shape] (a copy)."""
        if self.pages is not None:
            return self.pages.gather(i, meta.state_blocks)
        return self.state[i][meta.state_indices]

    def store_state(self, meta: StateMetadata, i: int, value: torch.Tensor) -> None:
        """Write value [R, *shape] back as state tensor i of every request of the step."""
        if self.pages is not None:
            self.pages.scatter(i, meta.state_blocks, value)
        else:
            self.state[i][meta.state_indices] = value.to(self.state[i].dtype)

    @contextmanager
    def request_state(self, meta: StateMetadata, i: int, r: int) -> Iterator[torch.Tensor]:
        """State tensor i of request r, [*shape], to update in place: a view of its block, or
        (a state over several blocks) a copy written back when the block ends."""
        if self.pages is None:
            yield self.state[i][meta.blocks[r]]
            return
        blocks = meta.state_blocks[r : r + 1]
        s = self.pages.gather(i, blocks)
        yield s[0]
        self.pages.scatter(i, blocks, s)


def state_layers(model: nn.Module) -> dict[str, StateLayer]:
    """The model's recurrent layers by module name, in layer order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, StateLayer)}
