"""The blocks of one KV cache group (vLLM v1's single_type_kv_cache_manager.py): which physical
blocks each request holds for the layers of that group, over the BlockPool every group shares.

FullAttentionManager keeps every block; SlidingWindowManager frees (puts the null block in
place of) the blocks that lie wholly before the window of every query the request has left,
and finds prefix-cache hits that need only the blocks inside the window. KVCacheManager
(core/kv_cache_manager.py) drives one of these per group.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional, Sequence

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.kv_cache_utils import cdiv


class SingleTypeKVCacheManager:
    sliding_window: Optional[int] = None

    def __init__(
        self,
        block_pool: BlockPool,
        block_size: int,
        group_id: int = 0,
        pending_copies: Optional[list[tuple[int, int]]] = None,
    ) -> None:
        """pending_copies: where copy-on-write records its (src, dst) block copies (shared by
        the groups: the runner copies a block id's page in every cache tensor)."""
        self.block_pool = block_pool
        self.block_size = block_size
        self.group_id = group_id
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        self.pending_copies = pending_copies if pending_copies is not None else []

    def cache_key(self, block_hash: int) -> int:
        """A group's blocks are its own: the same tokens in two groups are two cache entries
        (group 0 keeps the plain hash, so one group behaves as before groups)."""
        return block_hash if self.group_id == 0 else hash((block_hash, self.group_id))

    # ------------------------------------------------------------ prefix cache
    def find_longest_cache_hit(self, block_hashes: Sequence[int], max_num_blocks: int) -> list[KVCacheBlock]:
        """The longest run of cached blocks from the start, at most max_num_blocks."""
        blocks = []
        for h in block_hashes[:max_num_blocks]:
            block = self.block_pool.get_cached_block(self.cache_key(h))
            if block is None:
                break
            blocks.append(block)
        return blocks

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: Sequence[int], num_full: int) -> None:
        null = self.block_pool.null_block
        for i in range(num_full):
            if blocks[i].block_hash is None and blocks[i] is not null:
                self.block_pool.cache_block(blocks[i], self.cache_key(block_hashes[i]))

    # ------------------------------------------------------------ allocation
    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free blocks no query from num_computed_tokens on can see (full attention: none)."""

    def count(
        self, request_id: str, num_computed: int, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock]
    ) -> tuple[int, bool, int]:
        """(new blocks, whether the first write copies a shared last block, free blocks taken:
        the new ones, the copy, and cached hits taken out of the free queue). num_computed
        counts the hits in new_computed_blocks."""
        bs = self.block_size
        blocks = self.req_to_blocks.get(request_id, ())
        num_new_blocks = cdiv(num_computed + num_new_tokens, bs) - len(blocks) - len(new_computed_blocks)
        # Copy-on-write: the first write lands in a shared, partly filled last block.
        cow = bool(num_computed % bs and blocks and blocks[-1].ref_cnt > 1 and len(blocks) == cdiv(num_computed, bs))
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0) if new_computed_blocks else 0
        return num_new_blocks, cow, max(num_new_blocks, 0) + cow + num_evictable_hits

    def take_hits(self, request_id: str, new_computed_blocks: list[KVCacheBlock]) -> None:
        """The request takes its prefix-cache hits (out of the free queue if free). Every group
        takes its hits before any group takes new blocks: a new block is popped from the free
        queue, which may hold another group's hit."""
        self.block_pool.touch(new_computed_blocks)
        self.req_to_blocks[request_id].extend(new_computed_blocks)

    def allocate(self, request_id: str, num_computed: int, counted: tuple[int, bool, int]) -> list[KVCacheBlock]:
        """After take_hits: the new blocks `count` gave (the caller checked there is room) ->
        the blocks new to the request's table (a copy-on-write target first)."""
        num_new_blocks, cow, _ = counted
        blocks = self.req_to_blocks[request_id]
        self.remove_skipped_blocks(request_id, num_computed)  # hits before the window
        dst = None
        if cow:
            src = blocks[-1]
            dst = self.block_pool.get_new_blocks(1)[0]
            self.block_pool.free_blocks([src])
            blocks[-1] = dst
            self.pending_copies.append((src.block_id, dst.block_id))
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        blocks.extend(new_blocks)
        return ([dst] if cow else []) + new_blocks

    def fork(self, parent_id: str, child_id: str) -> None:
        blocks = self.req_to_blocks[parent_id]
        self.block_pool.touch(blocks)
        self.req_to_blocks[child_id] = list(blocks)

    def free(self, request_id: str) -> None:
        """Tail first: tails are the first to be evicted."""
        self.block_pool.free_blocks(reversed(self.req_to_blocks.pop(request_id, [])))

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds in this group (not counting the null block)."""
        null = self.block_pool.null_block
        return sum(1 for b in self.req_to_blocks.get(request_id, ()) if b is not null)


class FullAttentionManager(SingleTypeKVCacheManager):
    pass


class SlidingWindowManager(SingleTypeKVCacheManager):
    def __init__(
        self,
        block_pool: BlockPool,
        block_size: int,
        sliding_window: int,
        group_id: int = 0,
        pending_copies: Optional[list[tuple[int, int]]] = None,
    ) -> None:
        super().__init__(block_pool, block_size, group_id, pending_copies)
        self.sliding_window = sliding_window

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """A query at p attends to (p - W, p], so from num_computed_tokens on tokens
        [0, num_computed_tokens - W] are skipped; the table keeps the null block in their place."""
        blocks = self.req_to_blocks.get(request_id)
        num_skipped_blocks = (num_computed_tokens - self.sliding_window + 1) // self.block_size
        if not blocks or num_skipped_blocks <= 0:
            return
        null, freed = self.block_pool.null_block, []
        for i in range(min(num_skipped_blocks, len(blocks)) - 1, -1, -1):  # tail first
            if blocks[i] is null:
                break  # the blocks before it were freed earlier
            freed.append(blocks[i])
            blocks[i] = null
        self.block_pool.free_blocks(freed)

    def find_longest_cache_hit(self, block_hashes: Sequence[int], max_num_blocks: int) -> list[KVCacheBlock]:
        """The longest prefix whose next query's window is cached: scanning back from
        max_num_blocks, the first run of cdiv(W - 1, block_size) cached blocks (or a run
        reaching the start) ends the hit; the blocks before the run are the null block."""
        need = cdiv(self.sliding_window - 1, self.block_size)
        null = self.block_pool.null_block
        hit = [null] * max_num_blocks
        if need == 0:
            return hit  # a window of 1 sees no past token
        run = 0
        for i in range(max_num_blocks - 1, -1, -1):
            block = self.block_pool.get_cached_block(self.cache_key(block_hashes[i]))
            if block is None:
                run = 0
                continue
            hit[i] = block
            run += 1
            if run >= need:
                return hit[: i + run]
        return hit[:run]  # a run reaching block 0 (or none)
