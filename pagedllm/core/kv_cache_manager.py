"""KVCacheManager: which physical blocks each request holds, allocated as its tokens arrive."""
from __future__ import annotations

from collections import defaultdict
from typing import Optional

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.request import Request


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_caching)
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def allocate_slots(self, request: Request, num_new_tokens: int) -> Optional[list[KVCacheBlock]]:
        """Make room for `num_new_tokens` after the request's computed ones.

        Returns the newly allocated blocks (possibly none), or None when there are not enough
        free blocks — then nothing was allocated (all or nothing) and the caller preempts.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        blocks = self.req_to_blocks[request.request_id]
        num_required = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        num_new_blocks = num_required - len(blocks)
        if num_new_blocks > self.block_pool.get_num_free_blocks():
            return None
        if num_new_blocks <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        return new_blocks

    def free(self, request: Request) -> None:
        """Return all of a request's blocks, tail first (tails are the first to be evicted)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]
