"""KVCacheManager: which physical blocks each request holds, allocated as its tokens arrive.

Sharing happens three ways, all through block ref counts:
- prefix caching: a full block is known by a hash chained from its parent's hash and its own
  token ids (plus extra keys); a new request takes the longest run of cached blocks;
- fork: a child request (parallel sample, beam) starts with its parent's blocks;
- copy-on-write: before a request writes into a partly filled block that another request
  also holds, it gets a private copy (the copy itself is done by the model runner).

The blocks themselves are kept per KV cache group (core/kv_cache_utils.py), one manager a
group (core/single_type_kv_cache_manager.py) over one shared BlockPool. With a sliding window
W, a group's blocks that lie wholly before the window of every query the request has left to
compute are freed while it runs (vLLM's SlidingWindowManager): its block table keeps the null
block in their place. A model of one kind of layer (Llama; Mistral, whose every layer slides)
has one group and behaves as before groups; Gemma 3 has full and sliding groups, and a
prefix-cache hit needs every group to hit (a sliding group only inside the window).
A hybrid model's recurrent layers form state groups (core/state_kv_cache_manager.py): each
request holds a fixed number of blocks there; prefix caching keeps snapshots of the state at
block boundaries of prompts, and a hit needs the attention blocks and a snapshot at the same
boundary (the longest such). So that snapshots exist where later prompts will diverge, the
scheduler ends a prefill chunk where the prompt parts from cached ones (`prefill_chunk_end`).
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Optional, Sequence

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.encoder_cache_manager import block_image_keys
from pagedllm.core.kv_cache_utils import KVCacheConfig, cdiv
from pagedllm.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
)
from pagedllm.core.state_kv_cache_manager import StateManager
from pagedllm.request import Request


def hash_block_tokens(parent_hash: Optional[int], token_ids: tuple[int, ...], extra_keys: tuple = ()) -> int:
    """A block's identity: the whole prefix before it (through the parent's hash), its tokens,
    and extra keys (such as a LoRA id) that must never share. Python's hash of a tuple of
    ints and None is the same in every process (no string hashing is involved)."""
    return hash((parent_hash, token_ids, extra_keys))


def extend_block_hashes(
    hashes: list[int], token_ids: Sequence[int], block_size: int, extra_keys: tuple = (), images: Sequence = ()
) -> list[int]:
    """Append the hashes of token_ids' full blocks that `hashes` lacks, each chained from its
    parent's -> hashes. The KV cache manager (lazily, per request) and the data-parallel
    router (whole prompts) both hash this way, so a router's guess matches a replica's cache.
    images (the request's ImageInputs): a block also keys on the hashes of the images it covers,
    so the same text with another image never shares it."""
    n = len(token_ids) // block_size
    image_keys = block_image_keys(images, n, block_size) if images else None
    for i in range(len(hashes), n):
        parent = hashes[-1] if hashes else None
        keys = extra_keys + image_keys[i] if image_keys else extra_keys
        hashes.append(hash_block_tokens(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]), keys))
    return hashes


def check_fits_kv_cache(
    num_prompt_tokens: int,
    max_tokens: int,
    width: int,
    block_size: int,
    num_blocks: int,
    max_model_len: int,
    kv_cache_config: Optional[KVCacheConfig] = None,
    max_chunk: Optional[int] = None,
) -> None:
    """ValueError unless `width` sequences of the request at full length fit the cache at once
    (block 0 is the null block). A beam search needs this: its beams wait for each other.
    kv_cache_config with several groups (and max_chunk, the scheduler's token budget): a
    sliding group counts only the blocks of its window (KVCacheConfig.max_num_blocks)."""
    num_tokens = min(num_prompt_tokens + max_tokens, max_model_len)
    if kv_cache_config is not None and (kv_cache_config.is_hybrid or kv_cache_config.has_state):
        need = width * kv_cache_config.max_num_blocks(num_tokens, block_size, max_chunk or num_tokens)
    else:
        need = width * cdiv(num_tokens, block_size)
    if need > num_blocks - 1:
        what = f"{width} beams of " if width > 1 else ""
        raise ValueError(
            f"{what}prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) needs "
            f"{need} KV-cache blocks, more than the cache holds ({num_blocks - 1}); lower max_tokens"
            + (" or beam_width" if width > 1 else "")
            + " or give the KV cache more memory"
        )


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheBlocks(list):
    """get_computed_blocks' / allocate_slots' answer when the cache has several groups: a list
    of group 0's blocks (what a caller that knows one group reads), every group's in `groups`."""

    def __init__(self, groups: Sequence[list[KVCacheBlock]]) -> None:
        super().__init__(groups[0])
        self.groups = tuple(groups)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = False,
        num_cpu_blocks: int = 0,
        sliding_window: Optional[int] = None,
        kv_cache_config: Optional[KVCacheConfig] = None,
    ) -> None:
        """sliding_window: every layer attends to the last `sliding_window` tokens only
        None: keep every block. kv_cache_config
        (core/kv_cache_utils.py): the model's KV cache groups, each with its own block table;
        with one group its window is used."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.kv_cache_config = kv_cache_config
        if kv_cache_config is not None:
            windows = [g.sliding_window for g in kv_cache_config.kv_cache_groups]
            state = [g.state_blocks for g in kv_cache_config.kv_cache_groups]
        else:
            windows, state = [sliding_window], [None]
        # Recurrent-state groups (core/state_kv_cache_manager.py): swapped with the attention
        # blocks; cached as snapshots at block boundaries.
        self.has_state = any(n is not None for n in state)
        # The window every layer has (one group); None with several groups.
        self.sliding_window = windows[0] if len(windows) == 1 else None
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_caching)
        # (src, dst) block copies owed to copy-on-write (and to forked states), drained by the
        # scheduler each step.
        self.pending_copies: list[tuple[int, int]] = []
        self.managers: list[SingleTypeKVCacheManager] = [
            StateManager(self.block_pool, block_size, n, g, self.pending_copies)
            if n is not None
            else FullAttentionManager(self.block_pool, block_size, g, self.pending_copies)
            if w is None
            else SlidingWindowManager(self.block_pool, block_size, w, g, self.pending_copies)
            for g, (w, n) in enumerate(zip(windows, state))
        ]
        self.num_groups = len(self.managers)
        # Group 0's blocks of each request (with one group: all of them).
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = self.managers[0].req_to_blocks
        # Hashes of each request's full blocks, computed as its tokens arrive.
        self.req_to_block_hashes: defaultdict[str, list[int]] = defaultdict(list)
        self.stats = PrefixCacheStats()
        # Recurrent models: blocks of the prompt's prefix found in the attention groups (or,
        # without attention, among recent prompts) at admission, where the prompt parts from
        # earlier ones (a snapshot boundary).
        self.req_to_attn_hit: dict[str, int] = {}
        self.seen_prompt_blocks: OrderedDict[int, None] = OrderedDict()  # (recurrent layers only)
        # Swap space: CPU block ids (0 unused, like the null block), and the copies owed.
        self.free_cpu_blocks: list[int] = list(range(num_cpu_blocks - 1, 0, -1))
        # A swapped request's CPU blocks (every group's, in group order) and, per group, which
        # entries of its block table held one (False: a sliding window's null block).
        self.req_to_cpu_blocks: dict[str, list[int]] = {}
        self.req_to_swap_layout: dict[str, tuple[tuple[bool, ...], ...]] = {}
        self.pending_swap_out: list[tuple[int, int]] = []  # (device block, cpu block)
        self.pending_swap_in: list[tuple[int, int]] = []  # (cpu block, device block)

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    # ------------------------------------------------------------ prefix cache
    def _block_hashes(self, request: Request) -> list[int]:
        """Hashes of the request's full blocks (extended lazily as tokens arrive)."""
        return extend_block_hashes(
            self.req_to_block_hashes[request.request_id],
            request.all_token_ids,
            self.block_size,
            request.extra_keys,
            request.mm_inputs,
        )

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached blocks at the start of the request, and the number of
        tokens they hold. The last token is always left to compute, so there are logits. A
        request that asks for prompt logprobs takes none: it needs every prompt position's
        logits (as vLLM, it recomputes rather than return gaps). Several groups: a
        KVCacheBlocks, as long a hit in every group (vLLM's hybrid coordinator)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        hashes = self._block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self.num_groups == 1 and isinstance(self.managers[0], StateManager):
            self._remember_prompt(request, hashes)
            blocks = self.managers[0].find_longest_cache_hit(hashes, max_blocks)
            return blocks, len(blocks) * self.block_size
        if self.num_groups == 1:  # the plain longest cached prefix, as before groups
            blocks = SingleTypeKVCacheManager.find_longest_cache_hit(self.managers[0], hashes, max_blocks)
            return blocks, len(blocks) * self.block_size
        if self.has_state:
            self.req_to_attn_hit[request.request_id] = min(
                len(m.find_longest_cache_hit(hashes, max_blocks))
                for m in self.managers
                if not isinstance(m, StateManager)
            )
        # Shorten the hit until every group hits that far (a sliding group's hit at n blocks
        # need not hold at fewer: look again at the new length).
        while True:
            hits = [m.find_longest_cache_hit(hashes, max_blocks) for m in self.managers]
            shortest = min(len(h) for h in hits)
            if shortest == max_blocks:
                return KVCacheBlocks(hits), max_blocks * self.block_size
            max_blocks = shortest

    def _remember_prompt(self, request: Request, hashes: Sequence[int]) -> None:
        """A model of recurrent layers only has no attention blocks to tell where a prompt
        parts from earlier ones: the hashes of recent prompts' blocks do (at most num_blocks
        of them, least recently seen dropped first)."""
        seen = self.seen_prompt_blocks
        num_prompt_blocks = min(len(hashes), request.num_prompt_tokens // self.block_size)
        known = 0
        while known < num_prompt_blocks and hashes[known] in seen:
            known += 1
        self.req_to_attn_hit[request.request_id] = known
        for h in hashes[:num_prompt_blocks]:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.block_pool.num_blocks:
            seen.popitem(last=False)

    def _hits_by_group(self, new_computed_blocks) -> Sequence[list[KVCacheBlock]]:
        if isinstance(new_computed_blocks, KVCacheBlocks):
            return new_computed_blocks.groups
        if self.num_groups > 1 and new_computed_blocks:
            raise ValueError("a cache of several groups takes the KVCacheBlocks of get_computed_blocks")
        return (new_computed_blocks or [],) * self.num_groups

    # ------------------------------------------------------------ allocation
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Optional[list[KVCacheBlock]] = None,
        save_snapshots: bool = True,
    ) -> Optional[list[KVCacheBlock]]:
        """Make room for `num_new_tokens` after the request's computed ones (and after
        `new_computed_blocks`, prefix-cache hits not yet counted in num_computed_tokens).

        Returns the newly allocated blocks (possibly none; several groups: a KVCacheBlocks),
        or None when there are not enough free blocks — then nothing changed (all or nothing)
        and the caller preempts.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        hits = self._hits_by_group(new_computed_blocks)
        req_id = request.request_id
        self.remove_skipped_blocks(req_id, request.num_computed_tokens)
        num_computed = request.num_computed_tokens + len(hits[0]) * self.block_size
        counts = [m.count(req_id, num_computed, num_new_tokens, h) for m, h in zip(self.managers, hits)]
        if sum(c[2] for c in counts) > self.block_pool.get_num_free_blocks():
            return None
        for m, h in zip(self.managers, hits):  # all hits first, then any new block
            m.take_hits(req_id, h)
        new = [m.allocate(req_id, num_computed, c) for m, c in zip(self.managers, counts)]
        if self.enable_caching:
            # Blocks this step fills become findable at once: they are written in this step's
            # forward, before any later request could read them.
            num_full = min(num_computed + num_new_tokens, request.num_tokens) // self.block_size
            hashes = self._block_hashes(request)
            for m in self.managers:
                m.cache_full_blocks(m.req_to_blocks[req_id], hashes, num_full)
            if self.has_state and save_snapshots:
                self._save_snapshots(request, num_computed, hashes)
        return new[0] if self.num_groups == 1 else KVCacheBlocks(new)

    def _save_snapshots(self, request: Request, num_computed: int, hashes: Sequence[int]) -> None:
        """The request's computed tokens stand at a block boundary (of its prompt, or of its
        output as it decodes: a chat's next turn repeats both): keep its states there (each state
        group's StateManager.save_snapshot; the runner copies the blocks before this step's
        forward, so the copy is the state at that boundary). Async scheduling may count tokens
        not known yet: no hash, no snapshot."""
        k = num_computed // self.block_size
        if k == 0 or num_computed % self.block_size or k > len(hashes):
            return
        for m in self.managers:
            if isinstance(m, StateManager):
                m.save_snapshot(request.request_id, hashes[k - 1])

    def prefill_chunk_end(self, request: Request, num_computed: int, num_new_tokens: int) -> int:
        """num_new_tokens, or fewer so that the chunk from num_computed ends where the prompt's
        cached attention prefix ended at admission (where it parts from earlier prompts: the
        next prompt with that prefix resumes there). Only for recurrent models with prefix
        caching; a chunk that ends elsewhere leaves no snapshot. A prompt that shares no whole
        block with a cached one is never cut (no step is added to its time to first token)."""
        if not (self.enable_caching and self.has_state):
            return num_new_tokens
        cut = self.req_to_attn_hit.get(request.request_id, 0) * self.block_size
        return cut - num_computed if num_computed < cut < num_computed + num_new_tokens else num_new_tokens

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Sliding windows: free the request's blocks that no query from position
        num_computed_tokens on can see (SlidingWindowManager.remove_skipped_blocks)."""
        for m in self.managers:
            m.remove_skipped_blocks(request_id, num_computed_tokens)

    def num_blocks_to_allocate(self, request: Request, num_new_tokens: int) -> int:
        """Free blocks that allocate_slots(request, num_new_tokens) would take."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        return sum(
            m.count(request.request_id, request.num_computed_tokens, num_new_tokens, [])[2] for m in self.managers
        )

    def num_fork_blocks(self, request: Request) -> int:
        """Free blocks a fork of the request takes: its recurrent states, which are copied
        (attention blocks are shared)."""
        return sum(
            len(m.req_to_blocks.get(request.request_id, ())) for m in self.managers if isinstance(m, StateManager)
        )

    def can_fork(self, request: Request, num_children: int = 1) -> bool:
        return num_children * self.num_fork_blocks(request) <= self.num_free_blocks()

    def fork(self, parent: Request, child: Request) -> None:
        """The child starts with the parent's blocks, shared (ref counts); its recurrent states
        are copies (the caller checked `can_fork`)."""
        for m in self.managers:
            m.fork(parent.request_id, child.request_id)
        self.req_to_block_hashes[child.request_id] = list(self.req_to_block_hashes.get(parent.request_id, ()))

    # ------------------------------------------------------------ swap
    def swap_out(self, request: Request) -> bool:
        """Move a request's blocks in every group (attention KV and recurrent states alike) to
        CPU blocks and free its device blocks; False (nothing done) when the swap space is too
        full. A sliding group's blocks behind the window are dropped first (not swapped)."""
        rid = request.request_id
        self.remove_skipped_blocks(rid, request.num_computed_tokens)
        null = self.block_pool.null_block
        tables = [m.req_to_blocks.get(rid, []) for m in self.managers]
        held = [b for t in tables for b in t if b is not null]
        if len(held) > len(self.free_cpu_blocks):
            return False
        cpu = [self.free_cpu_blocks.pop() for _ in held]
        self.pending_swap_out.extend(zip((b.block_id for b in held), cpu))
        self.req_to_cpu_blocks[rid] = cpu
        self.req_to_swap_layout[rid] = tuple(tuple(b is not null for b in t) for t in tables)
        self.free(request)
        return True

    def is_swapped(self, request: Request) -> bool:
        return request.request_id in self.req_to_cpu_blocks

    def swap_in(self, request: Request, num_new_tokens: int) -> Optional[list[KVCacheBlock]]:
        """Bring a swapped request back, each group's table as it was (new device blocks, the
        null block where a window had dropped one), with room for `num_new_tokens` more ->
        group 0's table; None (nothing done) when the device has too few free blocks."""
        rid = request.request_id
        cpu, layout = self.req_to_cpu_blocks[rid], self.req_to_swap_layout[rid]
        if len(cpu) > self.block_pool.get_num_free_blocks():
            return None
        restored = self.block_pool.get_new_blocks(len(cpu))
        fresh, null = iter(restored), self.block_pool.null_block
        for m, kept in zip(self.managers, layout):
            m.req_to_blocks[rid] = [next(fresh) if k else null for k in kept]
        # No snapshot of the restored states: they are written after this step's block copies.
        if self.allocate_slots(request, num_new_tokens, save_snapshots=False) is None:
            self.free(request)
            return None
        self.pending_swap_in.extend(zip(cpu, (b.block_id for b in restored)))
        self.drop_swapped(request)
        return self.req_to_blocks[rid]

    def drop_swapped(self, request: Request) -> None:
        cpu = self.req_to_cpu_blocks.pop(request.request_id, None)
        self.req_to_swap_layout.pop(request.request_id, None)
        if cpu:
            self.free_cpu_blocks.extend(reversed(cpu))

    def take_pending_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        out, inn = self.pending_swap_out, self.pending_swap_in
        self.pending_swap_out, self.pending_swap_in = [], []
        return out, inn

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The step's block copies, made safe to run at once (the runner reads every source
        before it writes any destination): a copy out of a block an earlier copy wrote reads
        that copy's source instead, and a destination written twice keeps the last; so the
        answer equals the copies run in order (a state snapshot saved and hit in one step)."""
        src_of: dict[int, int] = {}
        for src, dst in self.pending_copies:
            src_of[dst] = src_of.get(src, src)
        self.pending_copies.clear()  # the same list object: the group managers append to it
        return [(src, dst) for dst, src in src_of.items() if src != dst]

    def free(self, request: Request) -> None:
        """Return all of a request's blocks, tail first (tails are the first to be evicted)."""
        for m in self.managers:
            m.free(request.request_id)
        self.req_to_block_hashes.pop(request.request_id, None)
        self.req_to_attn_hit.pop(request.request_id, None)

    def get_block_ids(self, request_id: str) -> list[int]:
        """Group 0's block table of the request (with one group: its whole table)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    # ------------------------------------------------------------ groups
    def get_block_ids_by_group(self, request_id: str) -> tuple[list[int], ...]:
        """Every group's block table of the request; () with one group (get_block_ids says all)."""
        if self.num_groups == 1:
            return ()
        return tuple([b.block_id for b in m.req_to_blocks.get(request_id, ())] for m in self.managers)

    def new_block_ids_by_group(self, blocks: list[KVCacheBlock]) -> tuple[list[int], ...]:
        """allocate_slots' answer as block ids per group; () with one group."""
        if not isinstance(blocks, KVCacheBlocks):
            return ()
        return tuple([b.block_id for b in g] for g in blocks.groups)

    def get_num_blocks_by_group(self, request_id: str) -> list[int]:
        """Blocks the request holds in each group (its freed sliding blocks not counted)."""
        return [m.num_held_blocks(request_id) for m in self.managers]
