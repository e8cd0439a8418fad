"""KV cache groups (no torch, no model): the layout read from per-layer windows, each group's
manager over the shared pool, prefix-cache hits that need every group, the admission bound."""

import pytest

from pagedllm.core.kv_cache_manager import KVCacheBlocks, KVCacheManager, check_fits_kv_cache
from pagedllm.core.kv_cache_utils import kv_cache_config_from_windows, make_kv_cache_config, merge_stage_configs
from pagedllm.core.block_pool import BlockPool
from pagedllm.core.single_type_kv_cache_manager import SlidingWindowManager
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

W, BS = 6, 4
# Gemma 3's pattern, shortened: local, local, global, local, local, global.
LAYERS = [W, W, None, W, W, None]


def req(rid, tokens):
    return Request(rid, tokens, SamplingParams(max_tokens=100), eos_token_id=None)


def step(kv, r, n, hits=None):
    assert kv.allocate_slots(r, n, hits) is not None
    r.num_computed_tokens += n


def test_layout_of_gemma3_270m():
    """15 local and 3 global layers: groups of 3 layers, 3 shared tensors, the global group first."""
    gemma = [None if i % 6 == 5 else 512 for i in range(18)]  # the windows its layers declare
    cfg = kv_cache_config_from_windows(gemma)
    assert cfg.is_hybrid and cfg.num_tensors == 3 and len(cfg.kv_cache_groups) == 6
    assert cfg.kv_cache_groups[0].layer_ids == (5, 11, 17) and cfg.kv_cache_groups[0].sliding_window is None
    assert [g.layer_ids for g in cfg.kv_cache_groups[1:3]] == [(0, 1, 2), (3, 4, 6)]
    assert sorted(i for g in cfg.kv_cache_groups for i in g.layer_ids) == list(range(18))
    # Each tensor is used by exactly one layer of each group.
    for g in cfg.kv_cache_groups:
        assert sorted(cfg.tensor_of_layer[i] for i in g.layer_ids) == [0, 1, 2]
    # One kind of layer (Mistral, Llama) or a pipeline split: one group, a tensor per layer.
    one = kv_cache_config_from_windows([8, 8, 8])
    assert not one.is_hybrid and one.kv_cache_groups[0].sliding_window == 8 and one.num_tensors == 3
    stage = kv_cache_config_from_windows(gemma[:9], one_group=True)
    assert not stage.is_hybrid and stage.kv_cache_groups[0].sliding_window is None and stage.num_tensors == 9


def test_pipeline_stages_merge_into_one_group():
    """The scheduler's layout of a split model: tensor-parallel ranks agree; stages keep one
    block table, freed behind a window only when every stage's layers slide by the same one."""
    full, sliding = kv_cache_config_from_windows([None] * 2), kv_cache_config_from_windows([8] * 2)
    assert merge_stage_configs([sliding, sliding]) == sliding
    assert merge_stage_configs([sliding, kv_cache_config_from_windows([8] * 3)]).kv_cache_groups[0].sliding_window == 8
    merged = merge_stage_configs([sliding, full])
    assert merged.kv_cache_groups[0].sliding_window is None and not merged.is_hybrid
    assert (
        merge_stage_configs([sliding, kv_cache_config_from_windows([4] * 2)]).kv_cache_groups[0].sliding_window is None
    )
    with pytest.raises(ValueError, match="one group each"):
        merge_stage_configs([make_kv_cache_config(LAYERS), full])


def test_sliding_group_frees_while_the_full_group_keeps_everything():
    kv = KVCacheManager(200, BS, kv_cache_config=make_kv_cache_config(LAYERS))
    assert kv.num_groups == 3 and [m.sliding_window for m in kv.managers] == [None, W, W]
    pool = kv.block_pool
    r = req("a", list(range(100)))
    step(kv, r, 10)
    assert kv.get_num_blocks_by_group("a") == [3, 3, 3]
    for _ in range(60):
        step(kv, r, 1)
        full, *local = kv.get_num_blocks_by_group("a")
        assert full == -(r.num_computed_tokens // -BS)
        assert all(n <= 3 for n in local)  # (computed - W, computed + 1] spans at most 3 blocks
        assert pool.get_num_free_blocks() == pool.num_blocks - 1 - full - sum(local)
    ids = kv.get_block_ids_by_group("a")
    assert ids[0] == kv.get_block_ids("a") and 0 not in ids[0]
    assert ids[1][:10] == [0] * 10 and len(ids[1]) == len(ids[0])  # null block in freed places
    assert not set(ids[0]) & set(b for b in ids[1] + ids[2] if b)  # a block is one group's
    kv.free(r)
    assert pool.get_num_free_blocks() == pool.num_blocks - 1


def test_allocate_returns_every_groups_new_blocks():
    kv = KVCacheManager(50, BS, kv_cache_config=make_kv_cache_config(LAYERS))
    blocks = kv.allocate_slots(req("a", list(range(9))), 9)
    assert isinstance(blocks, KVCacheBlocks) and [len(g) for g in blocks.groups] == [3, 3, 3]
    assert list(blocks) == blocks.groups[0]  # what a caller that knows one group reads
    by_group = kv.new_block_ids_by_group(blocks)
    assert list(by_group) == list(kv.get_block_ids_by_group("a"))
    # All or nothing: 3 groups x 2 blocks do not fit in 5 free blocks.
    small = KVCacheManager(6, BS, kv_cache_config=make_kv_cache_config(LAYERS))
    r = req("b", list(range(8)))
    assert small.allocate_slots(r, 8) is None and small.num_free_blocks() == 5
    assert small.num_blocks_to_allocate(r, 8) == 6


def test_sliding_window_cache_hit_needs_only_the_window():
    """Block 0 of a prefix evicted: full attention has no hit, the sliding manager still hits
    the blocks its window needs (cdiv(W - 1, BS) = 2 before the next query) with null before."""
    pool = BlockPool(20, enable_caching=True)
    sw = SlidingWindowManager(pool, BS, W)
    hashes = [11, 12, 13, 14]
    blocks = pool.get_new_blocks(4)
    for b, h in zip(blocks, hashes):
        pool.cache_block(b, h)
    pool._evict(blocks[0])
    hit = sw.find_longest_cache_hit(hashes, 4)
    assert hit == [pool.null_block, pool.null_block, blocks[2], blocks[3]]
    assert sw.find_longest_cache_hit(hashes, 3) == [pool.null_block, blocks[1], blocks[2]]
    pool._evict(blocks[2])  # block 3 alone is too little window: only the start can hit
    assert sw.find_longest_cache_hit(hashes, 4) == []


def test_prefix_hit_needs_every_group():
    kv = KVCacheManager(200, BS, enable_caching=True, kv_cache_config=make_kv_cache_config(LAYERS))
    prompt = list(range(30))
    a = req("a", prompt)
    step(kv, a, 30)
    kv.free(a)
    b = req("b", prompt + [99])
    hits, n = kv.get_computed_blocks(b)
    assert n == 28 and isinstance(hits, KVCacheBlocks)
    full, local = hits.groups[0], hits.groups[1]
    assert pool_ids(full) == kv_hit_ids(kv, a, 0) and 0 not in pool_ids(full)
    assert pool_ids(local)[:5] == [0] * 5 and 0 not in pool_ids(local)[5:]  # only the window
    step(kv, b, 3, hits)
    assert b.num_computed_tokens == 3 and kv.get_num_blocks_by_group("b")[0] == 8
    # A sliding group whose window blocks were evicted (not its hash chain's start): the hit
    # shortens to what every group has.
    kv2 = KVCacheManager(200, BS, enable_caching=True, kv_cache_config=make_kv_cache_config(LAYERS))
    c = req("c", prompt)
    step(kv2, c, 30)
    kv2.free(c)
    window_block = kv2.managers[1].find_longest_cache_hit(kv2._block_hashes(c), 7)[-1]
    kv2.block_pool._evict(window_block)
    d = req("d", prompt + [99])
    hits, n = kv2.get_computed_blocks(d)
    assert n == 24 and all(len(g) == 6 for g in hits.groups)  # blocks 4, 5 still make a window
    assert kv2.allocate_slots(d, 7, hits) is not None


def pool_ids(blocks):
    return [b.block_id for b in blocks]


def kv_hit_ids(kv, r, group):
    """The block ids request r's group `group` cached for its first 7 full blocks."""
    m = kv.managers[group]
    return [kv.block_pool.get_cached_block(m.cache_key(h)).block_id for h in kv._block_hashes(r)[:7]]


def test_fork_and_copy_on_write_per_group():
    kv = KVCacheManager(100, BS, kv_cache_config=make_kv_cache_config(LAYERS))
    p = req("p", list(range(6)))
    step(kv, p, 6)
    c = req("c", list(range(6)))
    c.num_computed_tokens = 6
    kv.fork(p, c)
    assert kv.get_block_ids_by_group("c") == kv.get_block_ids_by_group("p")
    c.append_output_token_ids([1])
    step(kv, c, 1)
    copies = kv.take_pending_copies()
    assert len(copies) == 3 and kv.pending_copies == []  # the shared last block, in each group
    kv.free(p)
    kv.free(c)
    assert kv.num_free_blocks() == 99


def test_admission_counts_the_window_only():
    cfg = make_kv_cache_config(LAYERS)
    # 200 tokens: 50 blocks in the global group, cdiv(5 + 16, 4) + 1 = 7 in each local one.
    assert cfg.max_num_blocks(200, BS, 16) == 50 + 7 + 7
    check_fits_kv_cache(150, 50, 1, BS, 65, 1000, cfg, 16)
    with pytest.raises(ValueError, match="needs 64 KV-cache blocks"):
        check_fits_kv_cache(150, 50, 1, BS, 64, 1000, cfg, 16)
    with pytest.raises(ValueError, match="needs 50 KV-cache blocks"):  # one group: every block
        check_fits_kv_cache(150, 50, 1, BS, 50, 1000)


def test_every_group_takes_its_hits_before_any_new_block():
    """A group's new block comes from the free queue's head, which may be another group's
    prefix-cache hit: all hits are taken first (else two groups would share a block)."""
    kv = KVCacheManager(7, BS, enable_caching=True, kv_cache_config=make_kv_cache_config(LAYERS))
    prompt = list(range(8))
    a = req("a", prompt)
    step(kv, a, 8)
    assert kv.num_free_blocks() == 0
    group1 = kv.managers[1].req_to_blocks.pop("a")
    kv.block_pool.free_blocks(group1)  # group 1's first block at the head of the free queue
    kv.free(a)
    b = req("b", prompt)
    hits, n = kv.get_computed_blocks(b)
    assert n == 4 and hits.groups[1][0] is group1[0]
    step(kv, b, 4, hits)
    held = [blk for g in kv.get_block_ids_by_group("b") for blk in g]
    assert len(held) == len(set(held)) == 6
    assert all(kv.block_pool.blocks[i].ref_cnt == 1 for i in held)
