"""Prefix caching, fork and copy-on-write in the KV cache manager, without a model (no torch)."""

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager, hash_block_tokens
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams


def req(rid, tokens, **kw):
    return Request(rid, tokens, SamplingParams(**kw), eos_token_id=None)


def test_hash_depends_on_parent_tokens_and_extra_keys():
    a = hash_block_tokens(None, (1, 2, 3, 4))
    assert a == hash_block_tokens(None, (1, 2, 3, 4))
    assert a != hash_block_tokens(None, (1, 2, 3, 5))
    assert hash_block_tokens(a, (5, 6, 7, 8)) != hash_block_tokens(hash_block_tokens(None, (9, 2, 3, 4)), (5, 6, 7, 8))
    assert hash_block_tokens(a, (5, 6, 7, 8)) != hash_block_tokens(a, (5, 6, 7, 8), ("lora-1",))
    assert hash_block_tokens(a, (5, 6, 7, 8), ("lora-1",)) != hash_block_tokens(a, (5, 6, 7, 8), ("lora-2",))


def test_extra_keys_never_share():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    r1 = req("a", list(range(10)))
    r1.extra_keys = ("lora-1",)
    assert kv.allocate_slots(r1, 10) is not None
    r2 = req("b", list(range(10)))
    r2.extra_keys = ("lora-2",)
    assert kv.get_computed_blocks(r2) == ([], 0)
    r3 = req("c", list(range(10)))
    r3.extra_keys = ("lora-1",)
    blocks, n = kv.get_computed_blocks(r3)
    assert n == 8 and [b.block_id for b in blocks] == kv.get_block_ids("a")[:2]


def test_eviction_order_scenario():
    """Hits, a partial block, and least-recently-freed eviction with tails first."""
    kv = KVCacheManager(num_blocks=9, block_size=4, enable_caching=True)  # blocks 1..8
    pool = kv.block_pool
    a = req("a", list(range(100, 110)))  # 10 tokens: 2 full blocks + a partial one
    assert [b.block_id for b in kv.allocate_slots(a, 10)] == [1, 2, 3]
    assert set(pool.cached_blocks.values()) == {pool.blocks[1], pool.blocks[2]}  # partial not cached
    b = req("b", list(range(100, 108)) + [7, 7, 7])  # shares a's 2 full blocks
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and [h.block_id for h in hits] == [1, 2]
    b.num_computed_tokens = 0
    assert [x.block_id for x in kv.allocate_slots(b, 3, hits)] == [4]
    assert pool.blocks[1].ref_cnt == 2 and pool.blocks[2].ref_cnt == 2
    # Only 8 tokens of a 9-token prompt can hit: the last token is always recomputed.
    c = req("c", list(range(100, 108)) + [1])
    assert kv.get_computed_blocks(c)[1] == 8
    c2 = req("c2", list(range(100, 108)))
    assert kv.get_computed_blocks(c2)[1] == 4
    kv.free(a)  # a's blocks: 3 (partial) goes to the free queue; 1 and 2 still held by b
    kv.free(b)  # b frees tail first: 4, then 2, 1
    assert pool.free_queue.block_ids() == [5, 6, 7, 8, 3, 4, 2, 1]
    # Freed full blocks keep their hash: a new request still hits them.
    d = req("d", list(range(100, 108)) + [9, 9])
    hits, n = kv.get_computed_blocks(d)
    assert [h.block_id for h in hits] == [1, 2]
    # Allocating 6 blocks evicts the least recently freed: 5, 6, 7, 8, then 3, 4 — not 1, 2.
    e = req("e", list(range(24)))
    assert [x.block_id for x in kv.allocate_slots(e, 24)] == [5, 6, 7, 8, 3, 4]
    assert kv.get_computed_blocks(d)[1] == 8
    # One more block: now the cached block 2 (freed before 1) is evicted and the hit shrinks.
    f = req("f", [1, 2, 3])
    assert [x.block_id for x in kv.allocate_slots(f, 3)] == [2]
    assert kv.get_computed_blocks(d)[1] == 4  # block 1 (the first) is still cached, block 2 gone
    assert pool.get_cached_block(hash_block_tokens(None, tuple(range(100, 104)))) is pool.blocks[1]
    assert pool.blocks[2].block_hash is None


def test_fork_and_copy_on_write():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=False)
    parent = req("p", list(range(10)))
    kv.allocate_slots(parent, 9)  # 9 tokens: blocks 1, 2, 3 (3 holds one token)
    parent.num_computed_tokens = 9
    kids = [req(f"{i}_p", list(range(10))) for i in range(3)]
    for k in kids:
        kv.fork(parent, k)
        k.num_computed_tokens = 9
    kv.free(parent)
    assert [b.ref_cnt for b in kv.req_to_blocks["0_p"]] == [3, 3, 3]
    # The first two writers into the shared partial block get a copy; the last keeps it.
    assert [b.block_id for b in kv.allocate_slots(kids[0], 1)] == [4]
    assert [b.block_id for b in kv.allocate_slots(kids[1], 1)] == [5]
    assert kv.allocate_slots(kids[2], 1) == []
    assert kv.take_pending_copies() == [(3, 4), (3, 5)]
    assert kv.get_block_ids("0_p") == [1, 2, 4]
    assert kv.get_block_ids("1_p") == [1, 2, 5]
    assert kv.get_block_ids("2_p") == [1, 2, 3]
    for k in kids:
        kv.free(k)
    assert kv.num_free_blocks() == 15


def test_scheduler_forks_parallel_samples_over_shared_prompt_blocks():
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=64), kv)
    sched.add_request(req("p", list(range(1, 11)), n=3, max_tokens=3, temperature=1.0))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"p": 9}  # the prompt but its last token
    sched.update_from_output(so, ModelRunnerOutput(["p"], [[]]))
    so = sched.schedule()  # forked: each sibling computes token 10
    assert so.num_scheduled_tokens == {"0_p": 1, "1_p": 1, "2_p": 1}
    assert {d.req_id for d in so.scheduled_new_reqs} == {"0_p", "1_p", "2_p"}
    assert "p" in so.finished_req_ids
    assert so.blocks_to_copy == [(3, 4), (3, 5)]
    assert kv.num_free_blocks() == 63 - 5  # 2 shared + 3 own tails
    step = 0
    while sched.has_unfinished_requests():
        ids = list(so.num_scheduled_tokens)
        sched.update_from_output(so, ModelRunnerOutput(ids, [[50 + step] for _ in ids]))
        step += 1
        so = sched.schedule()
    assert step == 3
    assert kv.num_free_blocks() == 63


def test_swap_out_in_and_fallback():
    kv = KVCacheManager(num_blocks=8, block_size=4, num_cpu_blocks=4)  # 3 usable CPU blocks
    a, b = req("a", list(range(10))), req("b", list(range(14)))
    kv.allocate_slots(a, 10)
    kv.allocate_slots(b, 14)
    a.num_computed_tokens, b.num_computed_tokens = 10, 14
    assert kv.get_block_ids("a") == [1, 2, 3]
    assert kv.swap_out(a)  # 3 blocks fit the swap space
    assert kv.num_free_blocks() == 7 - 4 and kv.is_swapped(a)
    assert not kv.swap_out(b)  # 4 blocks do not: nothing changes
    assert kv.get_block_ids("b") == [4, 5, 6, 7] and not kv.is_swapped(b)
    out, inn = kv.take_pending_swaps()
    assert [d for d, _ in out] == [1, 2, 3] and inn == []
    cpu_of_a = [c for _, c in out]
    assert kv.swap_in(a, 4) is None  # needs 4 blocks, 3 free
    kv.free(b)
    blocks = kv.swap_in(a, 4)  # 10 computed + 4 new tokens
    assert len(blocks) == 4 and not kv.is_swapped(a)
    out, inn = kv.take_pending_swaps()
    # The 3 swapped blocks come back into the first 3 new device blocks, in order.
    assert out == [] and inn == list(zip(cpu_of_a, [x.block_id for x in blocks[:3]]))
    assert len(kv.free_cpu_blocks) == 3
