"""KVCacheManager: which physical blocks each request holds, allocated as its tokens arrive.

Sharing happens three ways, all through block ref counts:
- prefix caching: a full block is known by a hash chained from its parent's hash and its own
  token ids (plus extra keys); a new request takes the longest run of cached blocks;
- fork: a child request (parallel sample, beam) starts with its parent's blocks;
- copy-on-write: before a request writes into a partly filled block that another request
  also holds, it gets a private copy (the copy itself is done by the model runner).

With a sliding window W on every layer (Mistral), a request's blocks that lie wholly before
the window of every query it has left to compute are freed while it runs (vLLM's
SlidingWindowManager): its block table keeps the null block in their place.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional, Sequence

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.request import Request


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def hash_block_tokens(parent_hash: Optional[int], token_ids: tuple[int, ...],
                      extra_keys: tuple = ()) -> int:
    """A block's identity: the whole prefix before it (through the parent's hash), its tokens,
    and extra keys (such as a LoRA id) that must never share. Python's hash of a tuple of
    ints and None is the same in every process (no string hashing is involved)."""
    return hash((parent_hash, token_ids, extra_keys))


def extend_block_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int,
                        extra_keys: tuple = ()) -> list[int]:
    """Append the hashes of token_ids' full blocks that `hashes` lacks, each chained from its
    parent's -> hashes. The KV cache manager (lazily, per request) and the data-parallel
    router (whole prompts) both hash this way, so a router's guess matches a replica's cache."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]), extra_keys))
    return hashes


def check_fits_kv_cache(num_prompt_tokens: int, max_tokens: int, width: int, block_size: int,
                        num_blocks: int, max_model_len: int) -> None:
    """ValueError unless `width` sequences of the request at full length fit the cache at once
    (block 0 is the null block). A beam search needs this: its beams wait for each other."""
    need = width * cdiv(min(num_prompt_tokens + max_tokens, max_model_len), block_size)
    if need > num_blocks - 1:
        what = f"{width} beams of " if width > 1 else ""
        raise ValueError(f"{what}prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) needs "
                         f"{need} KV-cache blocks, more than the cache holds ({num_blocks - 1}); lower max_tokens"
                         + (" or beam_width" if width > 1 else "") + " or give the KV cache more memory")


@dataclass
class PrefixCacheStats:
    queries: int = 0   # prompt tokens looked up
    hits: int = 0      # of which found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 num_cpu_blocks: int = 0, sliding_window: Optional[int] = None) -> None:
        """sliding_window: every layer attends to the last `sliding_window` tokens only
        (models/hf_config.kv_cache_sliding_window); None: keep every block."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_caching)
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        # Hashes of each request's full blocks, computed as its tokens arrive.
        self.req_to_block_hashes: defaultdict[str, list[int]] = defaultdict(list)
        # (src, dst) block copies owed to copy-on-write, drained by the scheduler each step.
        self.pending_copies: list[tuple[int, int]] = []
        self.stats = PrefixCacheStats()
        # Swap space: CPU block ids (0 unused, like the null block), and the copies owed.
        self.free_cpu_blocks: list[int] = list(range(num_cpu_blocks - 1, 0, -1))
        self.req_to_cpu_blocks: dict[str, list[int]] = {}
        self.pending_swap_out: list[tuple[int, int]] = []   # (device block, cpu block)
        self.pending_swap_in: list[tuple[int, int]] = []    # (cpu block, device block)

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    # ------------------------------------------------------------ prefix cache
    def _block_hashes(self, request: Request) -> list[int]:
        """Hashes of the request's full blocks (extended lazily as tokens arrive)."""
        return extend_block_hashes(self.req_to_block_hashes[request.request_id], request.all_token_ids,
                                   self.block_size, request.extra_keys)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached blocks at the start of the request, and the number of
        tokens they hold. The last token is always left to compute, so there are logits. A
        request that asks for prompt logprobs takes none: it needs every prompt position's
        logits (as vLLM, it recomputes rather than return gaps)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        hashes = self._block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for h in hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(h)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    # ------------------------------------------------------------ allocation
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Optional[list[KVCacheBlock]] = None
                       ) -> Optional[list[KVCacheBlock]]:
        """Make room for `num_new_tokens` after the request's computed ones (and after
        `new_computed_blocks`, prefix-cache hits not yet counted in num_computed_tokens).

        Returns the newly allocated blocks (possibly none), or None when there are not enough
        free blocks — then nothing changed (all or nothing) and the caller preempts.
        """
        new_computed_blocks = new_computed_blocks or []
        self.remove_skipped_blocks(request.request_id, request.num_computed_tokens)
        num_new_blocks, cow, num_taken = self._count(request, num_new_tokens, new_computed_blocks)
        if num_taken > self.block_pool.get_num_free_blocks():
            return None
        blocks = self.req_to_blocks[request.request_id]
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        self.remove_skipped_blocks(request.request_id, num_computed)   # hits before the window
        if cow:
            src = blocks[-1]
            dst = self.block_pool.get_new_blocks(1)[0]
            self.block_pool.free_blocks([src])
            blocks[-1] = dst
            self.pending_copies.append((src.block_id, dst.block_id))
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return ([dst] if cow else []) + new_blocks

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Sliding window: free the request's blocks that no query from position
        num_computed_tokens on can see (a query at p attends to (p - W, p]), so tokens
        [0, num_computed_tokens - W] are skipped; the table keeps the null block in their place."""
        if self.sliding_window is None:
            return
        blocks = self.req_to_blocks.get(request_id)
        num_skipped_blocks = (num_computed_tokens - self.sliding_window + 1) // self.block_size
        if not blocks or num_skipped_blocks <= 0:
            return
        null, freed = self.block_pool.null_block, []
        for i in range(min(num_skipped_blocks, len(blocks)) - 1, -1, -1):   # tail first
            if blocks[i] is null:
                break   # the blocks before it were freed earlier
            freed.append(blocks[i])
            blocks[i] = null
        self.block_pool.free_blocks(freed)

    def num_blocks_to_allocate(self, request: Request, num_new_tokens: int) -> int:
        """Free blocks that allocate_slots(request, num_new_tokens) would take."""
        return self._count(request, num_new_tokens, [])[2]

    def _count(self, request: Request, num_new_tokens: int,
               new_computed_blocks: list[KVCacheBlock]) -> tuple[int, bool, int]:
        """(new blocks, whether the first write copies a shared last block, free blocks taken:
        the new ones, the copy, and cached hits taken out of the free queue)."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        bs = self.block_size
        blocks = self.req_to_blocks.get(request.request_id, ())
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * bs
        num_new_blocks = cdiv(num_computed + num_new_tokens, bs) - len(blocks) - len(new_computed_blocks)
        # Copy-on-write: the first write lands in a shared, partly filled last block.
        cow = bool(num_computed % bs and blocks and blocks[-1].ref_cnt > 1 and len(blocks) == cdiv(num_computed, bs))
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0) if new_computed_blocks else 0
        return num_new_blocks, cow, max(num_new_blocks, 0) + cow + num_evictable_hits

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        """Blocks that this step fills become findable at once: they are written in this
        step's forward, before any later request could read them."""
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        hashes = self._block_hashes(request)
        for i in range(num_full):
            if blocks[i].block_hash is None and blocks[i] is not self.block_pool.null_block:
                self.block_pool.cache_block(blocks[i], hashes[i])

    def fork(self, parent: Request, child: Request) -> None:
        """The child starts with the parent's blocks, shared (ref counts)."""
        blocks = self.req_to_blocks[parent.request_id]
        self.block_pool.touch(blocks)
        self.req_to_blocks[child.request_id] = list(blocks)
        self.req_to_block_hashes[child.request_id] = list(self.req_to_block_hashes.get(parent.request_id, ()))

    # ------------------------------------------------------------ swap
    def swap_out(self, request: Request) -> bool:
        """Move a request's KV to CPU blocks and free its device blocks; False (nothing done)
        when the swap space is too full."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        if len(blocks) > len(self.free_cpu_blocks):
            return False
        cpu = [self.free_cpu_blocks.pop() for _ in blocks]
        self.pending_swap_out.extend(zip((b.block_id for b in blocks), cpu))
        self.req_to_cpu_blocks[request.request_id] = cpu
        self.free(request)
        return True

    def is_swapped(self, request: Request) -> bool:
        return request.request_id in self.req_to_cpu_blocks

    def swap_in(self, request: Request, num_new_tokens: int) -> Optional[list[KVCacheBlock]]:
        """Bring a swapped request back, with room for `num_new_tokens` more; None (nothing
        done) when the device has too few free blocks."""
        cpu = self.req_to_cpu_blocks[request.request_id]
        need = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        if need > self.block_pool.get_num_free_blocks():
            return None
        blocks = self.block_pool.get_new_blocks(need)
        self.req_to_blocks[request.request_id] = blocks
        self.pending_swap_in.extend(zip(cpu, (b.block_id for b in blocks)))
        self.free_cpu_blocks.extend(reversed(cpu))
        del self.req_to_cpu_blocks[request.request_id]
        return blocks

    def drop_swapped(self, request: Request) -> None:
        cpu = self.req_to_cpu_blocks.pop(request.request_id, None)
        if cpu:
            self.free_cpu_blocks.extend(reversed(cpu))

    def take_pending_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        out, inn = self.pending_swap_out, self.pending_swap_in
        self.pending_swap_out, self.pending_swap_in = [], []
        return out, inn

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def free(self, request: Request) -> None:
        """Return all of a request's blocks, tail first (tails are the first to be evicted)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.req_to_block_hashes.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]
