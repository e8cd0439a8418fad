"""Recurrent state as a KV cache group (no torch model): a state group holds a fixed number of
blocks per request whatever its length, from the pool the attention groups use; admission
counts them; a preempted request frees them (recompute) or swaps them out with its attention
blocks. Snapshots: test_state_snapshots.py."""

import pytest
import torch

from pagedllm.attention.kv_cache_spec import FullAttentionSpec, MambaSpec
from pagedllm.core.kv_cache_manager import KVCacheManager, check_fits_kv_cache
from pagedllm.core.kv_cache_utils import add_state_groups, make_kv_cache_config
from pagedllm.core.state_kv_cache_manager import StateManager
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

BS, STATE = 4, 3  # block size; blocks per request in each state group


def req(rid, tokens):
    return Request(rid, tokens, SamplingParams(max_tokens=100), eos_token_id=None)


def hybrid(num_attn=2, num_state=4, state_blocks=STATE):
    """LFM2's shape, shortened: a few attention layers, more recurrent ones."""
    return add_state_groups(make_kv_cache_config([None] * num_attn), num_state, state_blocks)


def test_layout_of_state_groups():
    cfg = hybrid()
    # 2 attention layers -> groups of 2; 4 state layers -> 2 state groups over the same 2 tensors.
    assert [g.layer_ids for g in cfg.kv_cache_groups] == [(0, 1), (2, 3), (4, 5)]
    assert [g.state_blocks for g in cfg.kv_cache_groups] == [None, STATE, STATE]
    assert cfg.num_tensors == 2 and cfg.tensor_of_layer == (0, 1, 0, 1, 0, 1)
    assert cfg.is_hybrid and cfg.has_state and not make_kv_cache_config([None] * 2).has_state
    # A request of 10 tokens: cdiv(10, 4) = 3 attention blocks, 3 in each state group.
    assert cfg.max_num_blocks(10, BS, 10) == 3 + 2 * STATE
    assert cfg.max_num_blocks(1000, BS, 10) == 250 + 2 * STATE
    with pytest.raises(ValueError, match="state_blocks"):
        add_state_groups(cfg, 2, 0)


def test_mamba_spec_bytes():
    """LFM2-like conv state (conv_dim 8, kernel - 1 = 2) and Mamba2-like SSM state (2 heads x 4 x 16),
    float32: (16 + 128) * 4 = 576 bytes a request; an attention page of 4 tokens x 2 heads x 8 x 2 (K, V)
    x 4 bytes = 512 bytes, so the state takes cdiv(576, 512) = 2 blocks."""
    spec = MambaSpec(block_size=BS, shapes=((8, 2), (2, 4, 16)), dtype=torch.float32)
    attn = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.float32)
    assert spec.state_bytes == 576 and attn.page_size_bytes == 512
    assert spec.blocks_per_request(attn.page_size_bytes) == 2
    assert spec.kv_shapes(5) == [(5, 8, 2), (5, 2, 4, 16)]
    with pytest.raises(ValueError, match="page_size_bytes"):
        spec.blocks_per_request(0)


def test_state_blocks_are_fixed_whatever_the_length():
    kv = KVCacheManager(100, BS, kv_cache_config=hybrid())
    assert [type(m) for m in kv.managers][1:] == [StateManager, StateManager]
    r = req("a", list(range(30)))
    for n in (5, 7, 18):  # chunked prefill: the state groups take their blocks once, at the first chunk
        assert kv.allocate_slots(r, n) is not None
        r.num_computed_tokens += n
        assert kv.get_num_blocks_by_group("a") == [-(-r.num_computed_tokens // BS), STATE, STATE]
    for _ in range(20):  # decode: the attention group grows, the states do not
        r.append_output_token_ids([1])
        assert kv.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
    assert kv.get_num_blocks_by_group("a") == [13, STATE, STATE]
    ids = kv.get_block_ids_by_group("a")
    assert len({b for g in ids for b in g}) == 13 + 2 * STATE  # every block is one group's
    kv.free(r)
    assert kv.num_free_blocks() == 99  # all back (block 0 is the null block)


def test_admission_counts_the_state_blocks():
    """7 attention blocks need 7 free; the states take 2 x 3 more: with 12 free the request waits
    (all or nothing), with 13 it runs; the frontend's bound counts the same."""
    cfg = hybrid()
    r = req("a", list(range(28)))
    assert KVCacheManager(13, BS, kv_cache_config=cfg).allocate_slots(r, 28) is None
    kv = KVCacheManager(14, BS, kv_cache_config=cfg)
    assert kv.num_blocks_to_allocate(r, 28) == 13
    assert kv.allocate_slots(r, 28) is not None and kv.num_free_blocks() == 0
    check_fits_kv_cache(20, 8, 1, BS, 14, 1000, cfg)
    with pytest.raises(ValueError, match="13 KV-cache blocks"):
        check_fits_kv_cache(20, 8, 1, BS, 13, 1000, cfg)


def test_preemption_recomputes_the_state():
    """Preempted by recompute, a hybrid request frees every block and, resumed from token 0,
    takes fresh state blocks."""
    kv = KVCacheManager(40, BS, kv_cache_config=hybrid())
    r = req("a", list(range(10)))
    assert kv.allocate_slots(r, 10) is not None
    kv.free(r)
    assert kv.num_free_blocks() == 39
    r.num_computed_tokens = 0
    assert kv.allocate_slots(r, 10) is not None
    assert kv.get_num_blocks_by_group("a") == [3, STATE, STATE]


def _moved(out, inn, before):
    """Where each block of the `before` tables lands through the swaps out and in."""
    to_cpu, from_cpu = dict(out), dict(inn)
    return [[from_cpu[to_cpu[b]] for b in table] for table in before]


def test_swap_moves_every_group_and_back_in_place():
    """10 tokens: 3 attention blocks and 3 in each state group, all 9 swapped out to CPU blocks
    and back into new device blocks, each into the same group and table position it left; the
    request resumes with room for 3 more tokens (13: a fourth attention block)."""
    kv = KVCacheManager(40, BS, num_cpu_blocks=40, kv_cache_config=hybrid())
    r = req("a", list(range(13)))
    assert kv.allocate_slots(r, 10) is not None
    r.num_computed_tokens = 10
    before = kv.get_block_ids_by_group("a")
    assert kv.swap_out(r) and kv.is_swapped(r)
    assert kv.num_free_blocks() == 39 and len(kv.free_cpu_blocks) == 39 - 9
    out = kv.pending_swap_out[:]
    # Another request takes 24 + 6 blocks: the 9 left would hold the swapped blocks but not
    # the fourth attention block as well, so the resume waits, nothing changed.
    other = req("b", list(range(96)))
    assert kv.allocate_slots(other, 96) is not None and kv.num_free_blocks() == 9
    assert kv.swap_in(r, 3) is None and kv.is_swapped(r) and kv.num_free_blocks() == 9
    assert kv.take_pending_swaps()[1] == [] and kv.get_block_ids_by_group("a") == ([], [], [])
    kv.free(other)
    assert kv.swap_in(r, 3) is not None and not kv.is_swapped(r)
    after = kv.get_block_ids_by_group("a")
    assert [len(t) for t in after] == [4, STATE, STATE]
    assert _moved(out, kv.take_pending_swaps()[1], before) == [after[0][:3], after[1], after[2]]
    assert len(kv.free_cpu_blocks) == 39
    kv.free(r)
    assert kv.num_free_blocks() == 39


def test_swap_leaves_the_blocks_behind_a_window():
    """A full and a sliding group (window 8, blocks of 4): after 20 tokens the sliding group's
    first (20 - 8 + 1) // 4 = 3 blocks are behind every later query's window; the swap drops
    them (null blocks, no CPU copy) and brings back the other 5 + 2, with room for one more
    token."""
    kv = KVCacheManager(40, BS, num_cpu_blocks=40, kv_cache_config=make_kv_cache_config([None, 8]))
    r = req("a", list(range(24)))
    assert kv.allocate_slots(r, 20) is not None
    r.num_computed_tokens = 20
    before = kv.get_block_ids_by_group("a")
    assert kv.swap_out(r) and len(kv.free_cpu_blocks) == 39 - 7
    out = kv.take_pending_swaps()[0]
    assert kv.swap_in(r, 1) is not None
    after = kv.get_block_ids_by_group("a")
    # 21 tokens: a sixth block in each group, new (not swapped).
    assert after[1][:3] == [0, 0, 0] and 0 not in after[1][3:] + after[0] and len(after[0]) == len(after[1]) == 6
    assert _moved(out, kv.take_pending_swaps()[1], [before[0], before[1][3:]]) == [after[0][:5], after[1][3:5]]
    kv.free(r)
    assert kv.num_free_blocks() == 39 and len(kv.free_cpu_blocks) == 39 - 7 + 7


def test_fork_copies_the_state():
    """A child (parallel sample, beam) shares the parent's attention blocks but gets its own
    state blocks, copied from the parent's by the runner."""
    kv = KVCacheManager(100, BS, kv_cache_config=hybrid())
    parent, child = req("p", list(range(9))), req("c", list(range(9)))
    assert kv.allocate_slots(parent, 8) is not None
    parent.num_computed_tokens = 8
    kv.take_pending_copies()
    kv.fork(parent, child)
    p_ids, c_ids = kv.get_block_ids_by_group("p"), kv.get_block_ids_by_group("c")
    assert c_ids[0] == p_ids[0]
    for g in (1, 2):
        assert len(c_ids[g]) == STATE and not set(c_ids[g]) & set(p_ids[g])
    assert sorted(kv.take_pending_copies()) == sorted(zip(p_ids[1] + p_ids[2], c_ids[1] + c_ids[2]))
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks() == 99


def test_a_fork_needs_room_for_the_state_copies():
    """A fork takes 2 x STATE blocks (two state groups): with 2 attention + 6 state blocks held
    of 14 usable, 6 are free: room for one child's states, not two. A model without state
    forks for free (its blocks are shared)."""
    kv = KVCacheManager(15, BS, kv_cache_config=hybrid())
    parent = req("p", list(range(9)))
    assert kv.allocate_slots(parent, 8) is not None
    assert kv.num_fork_blocks(parent) == 2 * STATE and kv.num_free_blocks() == 14 - 2 - 2 * STATE
    assert kv.can_fork(parent, 1) and not kv.can_fork(parent, 2) and kv.can_fork(parent, 0)
    plain = KVCacheManager(15, BS, kv_cache_config=make_kv_cache_config([None] * 2))
    assert plain.allocate_slots(parent, 8) is not None
    assert plain.num_fork_blocks(parent) == 0 and plain.can_fork(parent, 100)
