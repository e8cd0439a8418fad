"""The blocks of one recurrent-state group (vLLM v1's MambaManager): a layer that keeps a
fixed-size state per request (conv state, SSM or delta-rule state) needs the same blocks for
a request of 1 token as for one of 100k, so a request holds exactly `state_blocks` blocks of
the shared BlockPool from its first scheduled token until it is freed. Admission and
preemption then work as for attention blocks: allocate_slots counts these blocks with the
others (all or nothing), and a preempted request frees them and recomputes its state.

A request's own state is written in place every step, so it is never shared; a forked child
gets its own blocks, copied from the parent's (the runner copies the pages, as for
copy-on-write). Prefix caching keeps *snapshots* instead: when a request's computed tokens
stand at a block boundary, its state is copied into fresh blocks cached under
that boundary's block hash and freed at once (ref count 0: they wait in the free queue and are
evicted least recently used first, like any cached block). A later request whose prefix ends at
that boundary copies the snapshot into its own state blocks and computes from there.
"""

from __future__ import annotations

from typing import Optional, Sequence

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.single_type_kv_cache_manager import SingleTypeKVCacheManager


class StateManager(SingleTypeKVCacheManager):
    def __init__(
        self,
        block_pool: BlockPool,
        block_size: int,
        state_blocks: int,
        group_id: int = 0,
        pending_copies: Optional[list[tuple[int, int]]] = None,
    ) -> None:
        if state_blocks <= 0:
            raise ValueError(f"state_blocks must be > 0, got {state_blocks}")
        super().__init__(block_pool, block_size, group_id, pending_copies)
        self.state_blocks = state_blocks
        # The snapshot each admitted request resumes from, until its own blocks are allocated.
        self._resume_from: dict[str, list[KVCacheBlock]] = {}

    # ------------------------------------------------------------ snapshots
    def _snapshot_keys(self, block_hash: int) -> list[int]:
        """The cache keys of the snapshot at the boundary ending with block_hash's block: one
        per state block (the first is the group's plain key)."""
        key = self.cache_key(block_hash)
        return [key] + [hash((key, j)) for j in range(1, self.state_blocks)]

    def _cached_snapshot(self, block_hash: int) -> Optional[list[KVCacheBlock]]:
        blocks = [self.block_pool.get_cached_block(k) for k in self._snapshot_keys(block_hash)]
        return None if any(b is None for b in blocks) else blocks

    def find_longest_cache_hit(self, block_hashes: Sequence[int], max_num_blocks: int) -> list[KVCacheBlock]:
        """The longest boundary (at most max_num_blocks blocks) with a snapshot: max_num_blocks
        entries, the null block but the last, which is the snapshot's first block ([] none)."""
        null = self.block_pool.null_block
        for i in range(min(max_num_blocks, len(block_hashes)), 0, -1):
            snap = self._cached_snapshot(block_hashes[i - 1])
            if snap is not None:
                return [null] * (i - 1) + [snap[0]]
        return []

    def save_snapshot(self, request_id: str, block_hash: int) -> bool:
        """Copy the request's state (as its computed tokens stand, before this step's forward:
        the runner copies blocks first) into fresh blocks cached under block_hash, freed at once.
        -> False (nothing done) when a snapshot is there already or no block is free."""
        own = self.req_to_blocks.get(request_id)
        keys = self._snapshot_keys(block_hash)
        if not own or any(self.block_pool.get_cached_block(k) is not None for k in keys):
            return False
        if self.block_pool.get_num_free_blocks() < len(own):
            return False
        snap = self.block_pool.get_new_blocks(len(own))
        self.pending_copies.extend((src.block_id, dst.block_id) for src, dst in zip(own, snap))
        for block, key in zip(snap, keys):
            self.block_pool.cache_block(block, key)
        self.block_pool.free_blocks(snap)
        return True

    # ------------------------------------------------------------ allocation
    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: Sequence[int], num_full: int) -> None:
        pass  # a request's own state changes every step: it names no token prefix (save_snapshot does)

    def count(
        self, request_id: str, num_computed: int, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock]
    ) -> tuple[int, bool, int]:
        """The state's blocks once the request has any token, none after; a snapshot hit is
        taken out of the free queue while it is copied."""
        held = len(self.req_to_blocks.get(request_id, ()))
        need = self.state_blocks - held if num_computed + num_new_tokens > 0 else 0
        evictable = self.state_blocks if new_computed_blocks and new_computed_blocks[-1].ref_cnt == 0 else 0
        return need, False, max(need, 0) + evictable

    def take_hits(self, request_id: str, new_computed_blocks: list[KVCacheBlock]) -> None:
        """A hit is a snapshot: held (out of the free queue) until allocate copies it into the
        request's own blocks; the request's table holds its own blocks only."""
        self.req_to_blocks[request_id]
        if new_computed_blocks:
            snap = self._cached_snapshot_of(new_computed_blocks[-1])
            self.block_pool.touch(snap)
            self._resume_from[request_id] = snap

    def _cached_snapshot_of(self, first: KVCacheBlock) -> list[KVCacheBlock]:
        """Every block of the snapshot whose first block is `first` (found by its key)."""
        keys = [first.block_hash] + [hash((first.block_hash, j)) for j in range(1, self.state_blocks)]
        return [self.block_pool.get_cached_block(k) for k in keys]

    def allocate(self, request_id: str, num_computed: int, counted: tuple[int, bool, int]) -> list[KVCacheBlock]:
        """The request's own blocks; after a hit, the snapshot copied into them and let go (it
        stays cached, now the most recently used)."""
        new = super().allocate(request_id, num_computed, counted)
        snap = self._resume_from.pop(request_id, None)
        if snap is not None:
            own = self.req_to_blocks[request_id]
            self.pending_copies.extend((src.block_id, dst.block_id) for src, dst in zip(snap, own))
            self.block_pool.free_blocks(snap)
        return new

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child's own state, copied from the parent's (the caller made room)."""
        parent = self.req_to_blocks[parent_id]
        child = self.block_pool.get_new_blocks(len(parent))
        self.pending_copies.extend((src.block_id, dst.block_id) for src, dst in zip(parent, child))
        self.req_to_blocks[child_id] = child
