"""The blocks of one recurrent-state group (vLLM v1's MambaManager): a layer that keeps a
fixed-size state per request (conv state, SSM or delta-rule state) needs the same blocks for
a request of 1 token as for one of 100k, so a request holds exactly `state_blocks` blocks of
the shared BlockPool from its first scheduled token until it is freed. Admission and
preemption then work as for attention blocks: allocate_slots counts these blocks with the
others (all or nothing), and a preempted request frees them and recomputes its state.

A state is written in place every step, so it is never shared: no prefix-cache hits (the
state at a block boundary is not kept), and a forked child gets its own blocks, copied from
the parent's (the runner copies the pages, as for copy-on-write).
"""
from __future__ import annotations

from typing import Optional, Sequence

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.single_type_kv_cache_manager import SingleTypeKVCacheManager


class StateManager(SingleTypeKVCacheManager):
    def __init__(self, block_pool: BlockPool, block_size: int, state_blocks: int, group_id: int = 0,
                 pending_copies: Optional[list[tuple[int, int]]] = None) -> None:
        if state_blocks <= 0:
            raise ValueError(f"state_blocks must be > 0, got {state_blocks}")
        super().__init__(block_pool, block_size, group_id, pending_copies)
        self.state_blocks = state_blocks

    def find_longest_cache_hit(self, block_hashes: Sequence[int], max_num_blocks: int) -> list[KVCacheBlock]:
        return []   # no state snapshots at block boundaries: nothing to resume from

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: Sequence[int], num_full: int) -> None:
        pass   # a state block changes every step: it names no token prefix

    def count(self, request_id: str, num_computed: int, num_new_tokens: int,
              new_computed_blocks: list[KVCacheBlock]) -> tuple[int, bool, int]:
        """The state's blocks once the request has any token, none after."""
        held = len(self.req_to_blocks.get(request_id, ()))
        need = self.state_blocks - held if num_computed + num_new_tokens > 0 else 0
        return need, False, max(need, 0)

    def take_hits(self, request_id: str, new_computed_blocks: list[KVCacheBlock]) -> None:
        self.req_to_blocks[request_id]   # the request's (empty) table: hits never reach a state group

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child's own state, copied from the parent's (the caller made room)."""
        parent = self.req_to_blocks[parent_id]
        child = self.block_pool.get_new_blocks(len(parent))
        self.pending_copies.extend((src.block_id, dst.block_id) for src, dst in zip(parent, child))
        self.req_to_blocks[child_id] = child
