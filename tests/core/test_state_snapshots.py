"""Prefix caching for recurrent models (no torch model): a request's state is copied into
snapshot blocks at block boundaries of its prompt, cached under that boundary's block hash and
freed at once (evicted LRU with the other cached blocks); a later request resumes from the
longest boundary where the attention blocks and the snapshot are both cached."""

from pagedllm.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from pagedllm.core.kv_cache_utils import KVCacheConfig, KVCacheGroupSpec, add_state_groups, make_kv_cache_config
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams

BS = 4


def req(rid, tokens):
    return Request(rid, tokens, SamplingParams(max_tokens=100), eos_token_id=None)


def hybrid(state_blocks=1):
    """One attention group of 2 layers and one state group of 2 layers."""
    return add_state_groups(make_kv_cache_config([None] * 2), 2, state_blocks)


def run(kv, r, n, hits=None):
    """Schedule n tokens of r (after its hits) and count them computed -> the step's copies."""
    assert kv.allocate_slots(r, n, hits) is not None
    r.num_computed_tokens += (len(hits) * BS if hits else 0) + n
    return kv.take_pending_copies()


def test_a_snapshot_at_a_boundary_is_hit_by_the_same_prefix():
    kv = KVCacheManager(20, BS, enable_caching=True, kv_cache_config=hybrid())
    a = req("a", list(range(13)))
    assert run(kv, a, 8) == []  # 0 -> 8: no state to keep yet
    state_a = kv.get_block_ids_by_group("a")[1]
    free = kv.num_free_blocks()
    copies = run(kv, a, 5)  # at 8 (a boundary): the state is kept
    assert len(copies) == 1 and copies[0][0] == state_a[0]
    snap = copies[0][1]
    assert kv.num_free_blocks() == free - 1 - 1  # a's 4th attention block; the snapshot is free
    # b shares a's first 8 tokens: 2 attention blocks and the snapshot at 8.
    b = req("b", list(range(8)) + [50, 51, 52])
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and isinstance(hits, KVCacheBlocks)
    assert [x.block_id for x in hits.groups[0]] == kv.get_block_ids_by_group("a")[0][:2]
    copies = run(kv, b, 3, hits)
    assert copies == [(snap, kv.get_block_ids_by_group("b")[1][0])]
    for r in (a, b):
        kv.free(r)
    assert kv.num_free_blocks() == 19  # nothing leaked; the snapshot is cached, free


def test_the_hit_is_the_longest_boundary_with_both():
    """Attention blocks cached to 12, a snapshot at 4 only: the hit is 4 tokens."""
    kv = KVCacheManager(30, BS, enable_caching=True, kv_cache_config=hybrid())
    a = req("a", list(range(14)))
    run(kv, a, 4)
    assert len(run(kv, a, 9)) == 1  # snapshot at 4; 4 -> 13 in one chunk: none at 8, 12
    b = req("b", list(range(14)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 4 and len(hits.groups[0]) == 1 and kv.req_to_attn_hit["b"] == 3
    # b's prefill ends its first chunk where its cached attention prefix ended (12).
    assert kv.prefill_chunk_end(b, 4, 9) == 8
    assert kv.prefill_chunk_end(b, 12, 1) == 1


def test_a_prompt_that_shares_no_block_is_never_cut():
    kv = KVCacheManager(30, BS, enable_caching=True, kv_cache_config=hybrid())
    a = req("a", list(range(14)))
    kv.get_computed_blocks(a)
    assert kv.req_to_attn_hit["a"] == 0 and kv.prefill_chunk_end(a, 0, 14) == 14
    off = KVCacheManager(30, BS, enable_caching=False, kv_cache_config=hybrid())
    off.req_to_attn_hit["a"] = 2
    assert off.prefill_chunk_end(a, 0, 14) == 14


def test_snapshots_at_decode_boundaries():
    """A request that decodes past a block boundary keeps its state there too (a chat's next
    turn repeats the prompt and the answer); tokens counted but not known yet (async
    scheduling's placeholders) have no hash: no snapshot."""
    kv = KVCacheManager(30, BS, enable_caching=True, kv_cache_config=hybrid())
    a = req("a", list(range(6)))
    run(kv, a, 6)
    a.append_output_token_ids([40, 41, 42])
    # Steps from 6 and 7: no boundary; the step from 8 (a boundary) copies the state first.
    assert [len(run(kv, a, 1)) for _ in range(3)] == [0, 0, 1]
    b = req("b", list(range(6)) + [40, 41, 9])
    assert kv.get_computed_blocks(b)[1] == 8
    c = req("c", list(range(12)))
    run(kv, c, 12)
    assert kv.allocate_slots(c, 1) is not None and len(kv.take_pending_copies()) == 1  # at 12, all known
    c.num_computed_tokens = 16  # placeholders: 4 tokens scheduled, not known
    assert kv.allocate_slots(c, 1) is not None and kv.take_pending_copies() == []


def test_snapshots_are_evicted_with_the_free_blocks():
    """A pool of 9 usable blocks: a (8 tokens + 1) takes 3 attention + 1 state block and keeps
    a snapshot at 8; c then needs every block, so the snapshot is evicted and b misses."""
    kv = KVCacheManager(10, BS, enable_caching=True, kv_cache_config=hybrid())
    a = req("a", list(range(9)))
    run(kv, a, 8)
    assert len(run(kv, a, 1)) == 1
    kv.free(a)
    c = req("c", [90 + i for i in range(32)])
    assert kv.allocate_slots(c, 32) is not None and kv.num_free_blocks() == 0
    kv.free(c)
    b = req("b", list(range(9)))
    assert kv.get_computed_blocks(b)[1] == 0
    assert kv.num_free_blocks() == 9


def test_several_state_blocks_and_two_state_groups():
    """A state of 2 blocks in each of 2 state groups: the snapshot is 2 x 2 blocks, copied block
    for block, and a hit copies them back into the new request's own."""
    cfg = add_state_groups(make_kv_cache_config([None] * 2), 4, 2)
    kv = KVCacheManager(40, BS, enable_caching=True, kv_cache_config=cfg)
    a = req("a", list(range(9)))
    run(kv, a, 4)
    own_a = kv.get_block_ids_by_group("a")
    out = run(kv, a, 5)
    assert sorted(s for s, _ in out) == sorted(own_a[1] + own_a[2])
    b = req("b", list(range(9)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 4
    back = run(kv, b, 5, hits)
    own_b = kv.get_block_ids_by_group("b")
    snap_of = dict(out)  # a's state block -> its snapshot block
    assert sorted(back) == sorted((snap_of[src], dst) for src, dst in zip(own_a[1] + own_a[2], own_b[1] + own_b[2]))


def test_a_snapshot_saved_and_hit_in_one_step():
    """The runner reads every source before it writes: a copy out of the snapshot written in the
    same step reads the snapshot's own source instead."""
    kv = KVCacheManager(30, BS, enable_caching=True, kv_cache_config=hybrid())
    a = req("a", list(range(9)))
    run(kv, a, 4)
    state_a = kv.get_block_ids_by_group("a")[1][0]
    assert kv.allocate_slots(a, 5) is not None  # saves the snapshot at 4 (copy pending)
    b = req("b", list(range(9)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 4 and kv.allocate_slots(b, 5, hits) is not None
    state_b = kv.get_block_ids_by_group("b")[1][0]
    copies = kv.take_pending_copies()
    assert (state_a, state_b) in copies and len(copies) == 2


def test_recurrent_only_model():
    """Mamba2's layout: one state group, no attention. The hit is the snapshot alone."""
    cfg = KVCacheConfig((KVCacheGroupSpec((0, 1), None, 1),), 2, (0, 1))
    kv = KVCacheManager(20, BS, enable_caching=True, kv_cache_config=cfg)
    a = req("a", list(range(10)))
    run(kv, a, 8)
    assert len(run(kv, a, 2)) == 1
    b = req("b", list(range(8)) + [7, 7, 7])
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and len(hits) == 2
    copies = run(kv, b, 3, hits)
    assert len(copies) == 1 and copies[0][1] == kv.get_block_ids("b")[0]
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks() == 19


def test_a_recurrent_only_model_finds_where_prompts_part_from_recent_ones():
    """Without attention blocks, the hashes of recent prompts' blocks tell where a prompt parts
    from earlier ones (at most num_blocks hashes, oldest dropped first)."""
    cfg = KVCacheConfig((KVCacheGroupSpec((0,), None, 1),), 1, (0,))
    kv = KVCacheManager(4, BS, enable_caching=True, kv_cache_config=cfg)
    system = list(range(10))
    a, b = req("a", system + [50, 51, 52]), req("b", system + [60, 61, 62, 63])
    kv.get_computed_blocks(a)
    assert kv.req_to_attn_hit["a"] == 0
    kv.get_computed_blocks(b)
    assert kv.req_to_attn_hit["b"] == 2  # b parts from a in its third block
    assert kv.prefill_chunk_end(b, 0, 14) == 8  # so its first chunk ends at 8
    assert len(kv.seen_prompt_blocks) == 4  # a's 3 and b's third (bounded by 4 blocks)


def test_the_scheduler_ends_prefill_chunks_at_snapshot_boundaries():
    """Three prompts sharing 9 tokens (2 blocks and 1), 64-token budget: the first (14 tokens)
    runs whole; the second 0 -> 8 (where it parts from the first's cached blocks, keeping its
    state there), 8 -> 14; the third resumes at 8."""
    from pagedllm.config import SchedulerConfig
    from pagedllm.core.scheduler import Scheduler

    kv = KVCacheManager(40, BS, enable_caching=True, kv_cache_config=hybrid())
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv)
    system = list(range(9))
    chunks = []
    for i, tail in enumerate(([50, 51, 52, 53, 54], [60, 61, 62, 63, 64], [70, 71, 72])):
        r = Request(f"r{i}", system + tail, SamplingParams(max_tokens=1), eos_token_id=None)
        sched.add_request(r)
        while r.num_computed_tokens < r.num_prompt_tokens:
            n = sched.schedule().num_scheduled_tokens[r.request_id]
            chunks.append((r.request_id, r.num_computed_tokens - n, r.num_computed_tokens))
        sched.finish_requests([r.request_id], RequestStatus.FINISHED_ABORTED)
    assert chunks == [("r0", 0, 14), ("r1", 0, 8), ("r1", 8, 14), ("r2", 8, 12)]
    assert kv.stats.hits == 8


def test_a_swapped_in_request_saves_no_snapshot_of_states_not_yet_restored():
    """The runner copies blocks before it swaps blocks in (a copy may read a block freed this
    step that a swap-in overwrites), so a request swapped back in at a boundary must not save a
    snapshot out of its restored state blocks: they hold the state only after the copies. The
    preempted request's own pending snapshot, saved before its swap-out, reads a block that
    the step's copies see before any swap-in writes it."""
    kv = KVCacheManager(20, BS, num_cpu_blocks=20, enable_caching=True, kv_cache_config=hybrid())
    a = req("a", list(range(13)))
    run(kv, a, 4)
    assert kv.swap_out(a)
    kv.take_pending_swaps()
    assert kv.swap_in(a, 4) is not None  # at 4, a boundary: no snapshot out of the restored state
    assert kv.take_pending_copies() == []
    a.num_computed_tokens += 4
    assert len(run(kv, a, 4)) == 1  # at 8, on its own state again: kept
