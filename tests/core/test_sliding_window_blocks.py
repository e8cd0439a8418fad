"""The KV cache manager with a sliding window on every layer frees the blocks a request's
remaining queries cannot see, while it runs (no torch, no model)."""

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_cache_utils import kv_cache_config_from_windows
from pagedllm.models.hf_config import layer_sliding_windows, mixes_attention_windows
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams


def req(rid, tokens):
    return Request(rid, tokens, SamplingParams(max_tokens=100), eos_token_id=None)


def step(kv, r, n):
    """Allocate for n new tokens, then count them computed (what the scheduler does)."""
    assert kv.allocate_slots(r, n) is not None
    r.num_computed_tokens += n


def test_blocks_behind_the_window_are_freed_as_the_request_runs():
    # Window 6, blocks of 4: a query at p sees (p - 6, p]. With 10 computed the next query
    # (p >= 10) needs tokens >= 5: block 0 (tokens 0-3) goes; with 14, tokens >= 9: block 1.
    kv = KVCacheManager(num_blocks=20, block_size=4, sliding_window=6)
    pool, null = kv.block_pool, kv.block_pool.null_block
    r = req("a", list(range(40)))
    step(kv, r, 10)  # a prefill chunk: nothing is behind any window yet
    assert len(kv.req_to_blocks["a"]) == 3 and null not in kv.req_to_blocks["a"]
    step(kv, r, 4)  # allocated at 10 computed: block 0 freed
    ids = kv.get_block_ids("a")
    assert ids[0] == 0 and 0 not in ids[1:] and len(ids) == 4  # the null block in its place
    step(kv, r, 1)  # allocated at 14 computed: block 1 freed
    ids = kv.get_block_ids("a")
    assert ids[:2] == [0, 0] and 0 not in ids[2:]
    for _ in range(25):  # decode on: the request holds at most 3 blocks
        step(kv, r, 1)
        held = [b for b in kv.req_to_blocks["a"] if b is not null]
        assert len(held) <= 3
        assert pool.get_num_free_blocks() == pool.num_blocks - 1 - len(held)
    kv.free(r)
    assert pool.get_num_free_blocks() == pool.num_blocks - 1


def test_full_attention_keeps_every_block():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    r = req("a", list(range(40)))
    for n in (10, 4, 1, 1, 1):
        step(kv, r, n)
    assert 0 not in kv.get_block_ids("a") and len(kv.get_block_ids("a")) == 5


def test_prefix_cache_hits_of_a_sliding_request_stay_correct():
    """A freed block keeps its hash in the free queue: a later request with the same prefix
    finds the chain while it is cached; the null block is never hashed or handed out."""
    kv = KVCacheManager(num_blocks=20, block_size=4, enable_caching=True, sliding_window=6)
    r = req("a", list(range(20)))
    step(kv, r, 16)
    step(kv, r, 1)
    assert kv.get_block_ids("a")[0] == 0
    r2 = req("b", list(range(20)))
    blocks, n = kv.get_computed_blocks(r2)
    assert n == 16 and kv.block_pool.null_block not in blocks
    assert kv.allocate_slots(r2, 4, blocks) is not None
    r2.num_computed_tokens = 20
    # b's hits behind its window were given back at once: it holds only what it can see.
    assert kv.get_block_ids("b")[:2] == [0, 0]
    assert kv.block_pool.null_block.block_hash is None


def test_which_configs_free_blocks():
    mistral = {"model_type": "mistral", "num_hidden_layers": 3, "sliding_window": 4096}
    assert layer_sliding_windows(mistral) == [4096] * 3 and not mixes_attention_windows(mistral)
    assert kv_cache_window(mistral) == 4096
    assert kv_cache_window({**mistral, "sliding_window": None}) is None
    qwen2 = {"model_type": "qwen2", "num_hidden_layers": 2, "sliding_window": 4096}
    assert layer_sliding_windows(qwen2) == [None, None]  # use_sliding_window is off
    gemma = {"model_type": "gemma3_text", "num_hidden_layers": 7, "sliding_window": 512}
    assert layer_sliding_windows(gemma) == [512] * 5 + [None, 512]  # every 6th layer global
    assert mixes_attention_windows(gemma)
    assert kv_cache_window(gemma, pipeline_stage=True) is None  # one group: global layers keep every block


def kv_cache_window(hf_config, pipeline_stage=False):
    """The window the KV cache manager frees blocks behind, for a model of one group."""
    cfg = kv_cache_config_from_windows(layer_sliding_windows(hf_config), one_group=pipeline_stage)
    assert not cfg.is_hybrid
    return cfg.kv_cache_groups[0].sliding_window
