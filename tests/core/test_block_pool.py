"""BlockPool / FreeBlockQueue unit tests: no torch, no model, milliseconds.

The free queue is checked against a plain Python model (a list in eviction order) under
random sequences of get_new_blocks / free_blocks / touch.
"""

import pytest
from hypothesis import given, settings, strategies as st

from pagedllm.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from pagedllm.core.kv_cache_manager import KVCacheManager, cdiv
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams


def check_pool(pool: BlockPool, expected_free_order=None) -> None:
    """Structural invariants of the pool and its doubly linked free queue."""
    q = pool.free_queue
    # Walk forwards and backwards: the links agree and the count is the list's length.
    fwd, b = [], q._head.next_free
    while b is not q._tail:
        fwd.append(b)
        assert b.next_free.prev_free is b
        b = b.next_free
    bwd, b = [], q._tail.prev_free
    while b is not q._head:
        bwd.append(b)
        b = b.prev_free
    assert fwd == bwd[::-1]
    assert q.num_free_blocks == len(fwd) == pool.get_num_free_blocks()
    assert q.block_ids() == [b.block_id for b in fwd]
    free_ids = {b.block_id for b in fwd}
    assert len(free_ids) == len(fwd), "a block is twice in the free queue"
    # The null block: never free, never handed out, ref count pinned at 1.
    assert 0 not in free_ids
    assert pool.null_block.ref_cnt == 1
    assert pool.null_block.prev_free is None and pool.null_block.next_free is None
    for blk in pool.blocks[1:]:
        if blk.block_id in free_ids:
            assert blk.ref_cnt == 0, f"{blk} is free with ref_cnt > 0"
        else:
            assert blk.ref_cnt > 0, f"{blk} is neither free nor referenced"
            assert blk.prev_free is None and blk.next_free is None
    assert pool.get_usage() == pytest.approx(1 - len(fwd) / (pool.num_blocks - 1))
    if expected_free_order is not None:
        assert q.block_ids() == expected_free_order


# ---------------------------------------------------------------- basics
def test_fresh_pool_hands_out_blocks_in_id_order_never_block_0():
    pool = BlockPool(6)
    check_pool(pool, [1, 2, 3, 4, 5])
    assert pool.get_usage() == 0.0
    got = pool.get_new_blocks(5)
    assert [b.block_id for b in got] == [1, 2, 3, 4, 5]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.get_num_free_blocks() == 0 and pool.get_usage() == 1.0
    check_pool(pool, [])


def test_get_new_blocks_zero_is_a_no_op():
    pool = BlockPool(3)
    assert pool.get_new_blocks(0) == []
    check_pool(pool, [1, 2])


@pytest.mark.parametrize("num_blocks", [-1, 0, 1])
def test_pool_needs_at_least_two_blocks(num_blocks):
    with pytest.raises(ValueError):
        BlockPool(num_blocks)


def test_taking_more_blocks_than_free_raises_and_changes_nothing():
    pool = BlockPool(5)
    held = pool.get_new_blocks(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    check_pool(pool, [3, 4])  # all or nothing: the two free blocks are still there
    pool.free_blocks(held)
    with pytest.raises(ValueError):
        pool.get_new_blocks(5)
    check_pool(pool, [3, 4, 1, 2])


def test_popleft_of_empty_queue_raises_value_error():
    q = FreeBlockQueue([])
    assert q.num_free_blocks == 0 and q.block_ids() == []
    with pytest.raises(ValueError):
        q.popleft()


def test_remove_of_a_block_not_in_the_queue_raises():
    blocks = [KVCacheBlock(i) for i in range(3)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[1])
    assert q.block_ids() == [0, 2] and q.num_free_blocks == 2
    with pytest.raises(RuntimeError):
        q.remove(blocks[1])
    assert q.block_ids() == [0, 2] and q.num_free_blocks == 2


def test_double_free_raises():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(RuntimeError):
        pool.free_blocks([b])
    check_pool(pool, [2, 3, 1])


def test_free_of_a_never_allocated_block_raises():
    pool = BlockPool(4)
    with pytest.raises(RuntimeError):
        pool.free_blocks([pool.blocks[2]])
    check_pool(pool, [1, 2, 3])


def test_freeing_the_null_block_is_ignored():
    pool = BlockPool(3)
    pool.free_blocks([pool.null_block, pool.null_block])
    check_pool(pool, [1, 2])


def test_reuse_is_least_recently_freed_first():
    pool = BlockPool(7)
    blocks = {b.block_id: b for b in pool.get_new_blocks(6)}
    for i in (4, 1, 6):
        pool.free_blocks([blocks[i]])
    pool.free_blocks([blocks[3], blocks[2]])
    check_pool(pool, [4, 1, 6, 3, 2])
    assert [b.block_id for b in pool.get_new_blocks(2)] == [4, 1]
    pool.free_blocks([blocks[5]])
    check_pool(pool, [6, 3, 2, 5])


def test_shared_block_joins_the_queue_only_at_its_last_reference():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.touch([a])  # a second holder (prefix hit / parallel sampling)
    assert a.ref_cnt == 2
    pool.free_blocks([a])
    assert a.ref_cnt == 1
    check_pool(pool, [3])
    pool.free_blocks([b, a])
    check_pool(pool, [3, 2, 1])


def test_touch_takes_a_free_block_out_of_the_middle():
    pool = BlockPool(6)
    pool.touch([pool.blocks[3]])
    assert pool.blocks[3].ref_cnt == 1
    check_pool(pool, [1, 2, 4, 5])
    assert [b.block_id for b in pool.get_new_blocks(4)] == [1, 2, 4, 5]
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_kv_cache_manager_frees_tail_blocks_first():
    """free() passes a request's blocks reversed: its tail blocks are evicted first."""
    kv = KVCacheManager(num_blocks=7, block_size=4)
    a = Request("a", list(range(12)), SamplingParams())
    b = Request("b", list(range(12)), SamplingParams())
    assert [blk.block_id for blk in kv.allocate_slots(a, 12)] == [1, 2, 3]
    assert [blk.block_id for blk in kv.allocate_slots(b, 12)] == [4, 5, 6]
    assert kv.num_free_blocks() == 0
    assert kv.allocate_slots(Request("c", [1], SamplingParams()), 1) is None
    kv.free(b)
    kv.free(a)
    check_pool(kv.block_pool, [6, 5, 4, 3, 2, 1])
    assert kv.num_free_blocks() == 6 and kv.usage == 0.0
    assert [blk.block_id for blk in kv.block_pool.get_new_blocks(6)] == [6, 5, 4, 3, 2, 1]


def test_kv_cache_manager_allocates_only_what_the_new_tokens_need():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    r = Request("r", list(range(10)), SamplingParams())
    assert len(kv.allocate_slots(r, 3)) == 1  # tokens 0..2: one block
    r.num_computed_tokens = 3
    assert kv.allocate_slots(r, 1) == []  # token 3 still fits in block 1
    r.num_computed_tokens = 4
    assert len(kv.allocate_slots(r, 6)) == 2  # tokens 4..9: blocks 2 and 3
    r.num_computed_tokens = 10
    assert kv.get_block_ids("r") == [1, 2, 3]
    assert kv.allocate_slots(r, 7) is None  # needs 2 more, 1 free: nothing taken
    assert kv.get_block_ids("r") == [1, 2, 3] and kv.num_free_blocks() == 1
    with pytest.raises(ValueError):
        kv.allocate_slots(r, -1)
    kv.free(r)
    assert kv.num_free_blocks() == 4 and kv.get_block_ids("r") == []
    kv.free(r)  # freeing twice is harmless here
    assert kv.num_free_blocks() == 4


def test_prefix_cache_bookkeeping():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 111)
    pool.cache_block(b, 111)  # the hash is taken: b is not cached
    assert pool.get_cached_block(111) is a and b.block_hash is None
    pool.free_blocks([b, a])
    assert a.block_hash == 111 and pool.get_cached_block(111) is a  # free but still cached
    check_pool(pool, [3, 2, 1])
    pool.touch([a])  # a cache hit takes it back from the middle
    check_pool(pool, [3, 2])
    pool.free_blocks([a])
    check_pool(pool, [3, 2, 1])
    got = pool.get_new_blocks(3)  # reused: evicted from the cache
    assert got[-1] is a and a.block_hash is None and pool.get_cached_block(111) is None


def test_without_caching_freed_blocks_forget_their_hash():
    pool = BlockPool(3, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    a.block_hash = 5
    pool.free_blocks([a])
    assert a.block_hash is None


# ---------------------------------------------------------------- random operations
ops = st.lists(
    st.one_of(
        st.tuples(st.just("get"), st.integers(0, 12)),
        st.tuples(st.just("free"), st.lists(st.integers(0, 10_000), max_size=6)),
        st.tuples(st.just("touch"), st.lists(st.integers(0, 10_000), max_size=4)),
        st.tuples(st.just("double_free"), st.integers(0, 10_000)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(2, 12), ops=ops)
def test_free_queue_invariants_under_random_operations(num_blocks, ops):
    pool = BlockPool(num_blocks)
    model_free = list(range(1, num_blocks))  # eviction order: head first
    refs = {i: 0 for i in range(1, num_blocks)}  # the model's ref counts
    check_pool(pool, model_free)
    for op, arg in ops:
        if op == "get":
            n = arg
            if n > len(model_free):
                with pytest.raises(ValueError):
                    pool.get_new_blocks(n)
            else:
                got = pool.get_new_blocks(n)
                assert [b.block_id for b in got] == model_free[:n]  # head of the queue first
                del model_free[:n]
                for b in got:
                    assert b.block_id != 0 and b.ref_cnt == 1
                    refs[b.block_id] = 1
        elif op == "free":
            # Free some referenced blocks (a block may appear as often as it has references),
            # in the drawn order; those that reach zero join the tail in that order.
            held = [i for i, r in refs.items() for _ in range(r)]
            chosen = []
            for k in arg:
                if not held:
                    break
                chosen.append(held.pop(k % len(held)))
            pool.free_blocks([pool.blocks[i] for i in chosen])
            for i in chosen:
                refs[i] -= 1
                if refs[i] == 0:
                    model_free.append(i)
        elif op == "touch":
            chosen = [1 + k % (num_blocks - 1) for k in arg]
            pool.touch([pool.blocks[i] for i in chosen])
            for i in chosen:
                if refs[i] == 0:
                    model_free.remove(i)
                refs[i] += 1
        else:  # double free of a block with no reference left
            free = [i for i, r in refs.items() if r == 0]
            if free:
                i = free[arg % len(free)]
                with pytest.raises(RuntimeError):
                    pool.free_blocks([pool.blocks[i]])
        check_pool(pool, model_free)
        assert all(pool.blocks[i].ref_cnt == r for i, r in refs.items())


@settings(max_examples=150, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4, 16]),
    num_blocks=st.integers(2, 20),
    steps=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40)), max_size=40),
)
def test_kv_cache_manager_random_growth_and_free(block_size, num_blocks, steps):
    """Requests grow by random amounts and end at random; ownership stays exclusive and the
    free queue always gets a freed request's blocks tail first."""
    kv = KVCacheManager(num_blocks, block_size)
    pool = kv.block_pool
    reqs = {i: Request(str(i), [0], SamplingParams()) for i in range(4)}
    model_free = list(range(1, num_blocks))
    for who, n in steps:
        r = reqs[who]
        if n % 7 == 0:  # this request ends
            blocks = kv.get_block_ids(r.request_id)
            kv.free(r)
            model_free.extend(reversed(blocks))
            r.num_computed_tokens = 0
        else:
            before = kv.get_block_ids(r.request_id)
            need = cdiv(r.num_computed_tokens + n, block_size) - len(before)
            got = kv.allocate_slots(r, n)
            if need > len(model_free):
                assert got is None
                assert kv.get_block_ids(r.request_id) == before
            else:
                assert [b.block_id for b in got] == model_free[: max(need, 0)]
                del model_free[: max(need, 0)]
                r.num_computed_tokens += n
                assert len(kv.get_block_ids(r.request_id)) == cdiv(r.num_computed_tokens, block_size)
        check_pool(pool, model_free)
        owners = {}
        for rid, blocks in kv.req_to_blocks.items():
            for b in blocks:
                assert b.block_id not in owners, "a block is held by two requests"
                owners[b.block_id] = rid
                assert b.ref_cnt == 1
        assert len(owners) + pool.get_num_free_blocks() == num_blocks - 1
    for r in reqs.values():
        kv.free(r)
    assert pool.get_num_free_blocks() == num_blocks - 1
