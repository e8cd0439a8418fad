"""Sliding-window attention and Gemma 3 against transformers' generate on the same random
weights (small configs made with transformers' own classes), token for token, under chunked
prefill with tiny blocks, a tight token budget and a cache small enough to preempt, with
prompts longer than the window. A Mistral with a window frees its blocks behind the window
while it runs; a Gemma 3 (global and local layers) frees them in its local layers' KV cache
groups (core/kv_cache_utils.py)."""

import numpy as np
import pytest
import torch
from greedy_utils import assert_greedy_equal, hf_greedy
from kernel_utils import require_built

from pagedllm import LLM, SamplingParams
from pagedllm.models.random_model import BOS, EOS, UNK, _write_tokenizer

MAX_TOKENS = 24
VOCAB = 256
WINDOW = 24


def _save(model, tmp_path):
    model.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path, VOCAB)
    return tmp_path


def _init(model, std=0.2):
    """Weights far from uniform logits, so that greedy has no near-ties to flip."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, std)
    return model.eval()


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        sliding_window=WINDOW,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=UNK,
    )
    return _save(_init(MistralForCausalLM(cfg)), tmp_path_factory.mktemp("mistral-sw"))


def _gemma(out, window, layer_types):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        sliding_window=window,
        layer_types=layer_types,
        query_pre_attn_scalar=24,
        final_logit_softcapping=30.0,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
        },
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=UNK,
    )
    model = _init(Gemma3ForCausalLM(cfg))
    with torch.no_grad():  # Gemma's norms scale by (1 + weight): make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    return _save(model, out)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return _gemma(
        tmp_path_factory.mktemp("gemma3"), WINDOW, ["sliding_attention", "full_attention", "sliding_attention"]
    )


def _prompts(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, n).tolist() for n in (5, 23, 40, 70, 97)]


def _reference(model_dir, prompts):
    """transformers' greedy, EOS held back for MAX_TOKENS (min_new_tokens = our min_tokens)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return hf_greedy(model, prompts, MAX_TOKENS, min_new_tokens=MAX_TOKENS)


def _assert_equal(outs, refs, label):
    assert_greedy_equal(outs, refs, label, max_ties=1)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)


def _generate(llm, prompts):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


@pytest.fixture(scope="module")
def mistral_reference(mistral_dir):
    return _reference(mistral_dir, _prompts())


@pytest.mark.parametrize("decode_by_pages", [True, False], ids=["cpu-kernel", "sdpa"])
def test_mistral_sliding_window_equals_transformers(mistral_dir, mistral_reference, decode_by_pages, monkeypatch):
    """Every layer slides: blocks behind the window are freed as the requests run, a cache of
    about one long request preempts, and a second pass over the same prompts hits the prefix
    cache."""
    from pagedllm.attention.backends.cpu_attn import kernels as cpu_kernels

    if decode_by_pages:
        require_built(cpu_kernels.decode_kernel())
    else:  # the SDPA backend: decodes gather the window's slots
        monkeypatch.setattr(cpu_kernels, "cpu_decode_supported", lambda dtype: False)
    prompts, refs = _prompts(), mistral_reference
    llm = LLM(str(mistral_dir), block_size=4, max_num_batched_tokens=16, num_gpu_blocks=32)
    assert llm.llm_engine.core.model_executor.driver_worker.model_runner.attn_backend.decode_by_pages is decode_by_pages
    kv = llm.llm_engine.core.scheduler.kv_cache_manager
    assert kv.sliding_window == WINDOW
    _assert_equal(_generate(llm, prompts), refs, f"mistral by_pages={decode_by_pages}")
    assert llm.llm_engine.num_preemptions > 0
    _assert_equal(_generate(llm, prompts), refs, f"mistral by_pages={decode_by_pages}, prefix cache")
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_blocks - 1


@pytest.fixture(scope="module")
def gemma_reference(gemma_dir):
    return _reference(gemma_dir, _prompts(1))


@pytest.mark.parametrize("tp", [1, 2])
def test_gemma3_equals_transformers(gemma_dir, gemma_reference, tp, monkeypatch):
    """Local and global layers, per-type RoPE (linear scaling on the global ones), q/k norms,
    soft-capped logits; chunked prefill with tiny blocks and preemption; tensor parallel 2
    (2 query heads a rank, the one KV head replicated)."""
    monkeypatch.setenv("PAGEDLLM_WORKER_THREADS", "1")
    # KV cache groups: a block is one layer's page (one global, two local groups of one layer),
    # so 120 blocks are the memory 40 blocks of all three layers were.
    llm = LLM(str(gemma_dir), block_size=4, max_num_batched_tokens=16, num_gpu_blocks=120, tensor_parallel_size=tp)
    try:
        kv = llm.llm_engine.core.scheduler.kv_cache_manager
        assert kv.sliding_window is None and [m.sliding_window for m in kv.managers] == [None, WINDOW, WINDOW]
        _assert_equal(_generate(llm, _prompts(1)), gemma_reference, f"gemma3 tp={tp}")
        assert llm.llm_engine.num_preemptions > 0
    finally:
        llm.shutdown()


# ---------------------------------------------------------------- KV cache groups
GROUPS_WINDOW = 8
LONG_TOKENS = 100


@pytest.fixture(scope="module")
def gemma_groups_dir(tmp_path_factory):
    """Gemma 3's pattern over 6 layers: groups of 2 layers (one global, two local) over 2 tensors."""
    local, full = "sliding_attention", "full_attention"
    return _gemma(tmp_path_factory.mktemp("gemma3-groups"), GROUPS_WINDOW, [local, local, full] * 2)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_gemma3_kv_cache_groups_free_local_blocks(gemma_groups_dir, mode):
    """Prompts up to 7 windows long and a long generation, blocks of 4, a 16-token budget, a
    cache that preempts (by recompute, or by swapping every group's blocks out and back, the
    local groups' blocks behind the window left behind): greedy equals transformers, and every
    local group of a decoding request holds at most the 3 blocks its window spans (its global
    group: all of them); a second pass hits the prefix cache (the local groups only inside the
    window) and gives the same tokens."""
    from transformers import AutoModelForCausalLM

    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (5, 19, 40, 61, 20)]
    lengths = [MAX_TOKENS] * 4 + [LONG_TOKENS]
    hf = AutoModelForCausalLM.from_pretrained(gemma_groups_dir, dtype=torch.float32).eval()
    refs = [hf_greedy(hf, [p], n, min_new_tokens=n)[0] for p, n in zip(prompts, lengths)]
    llm = LLM(
        str(gemma_groups_dir),
        block_size=4,
        max_num_batched_tokens=16,
        num_gpu_blocks=60,
        preemption_mode=mode,
        num_cpu_blocks=128,
    )
    engine = llm.llm_engine
    kv = engine.core.scheduler.kv_cache_manager
    assert [m.sliding_window for m in kv.managers] == [None, GROUPS_WINDOW, GROUPS_WINDOW]
    runner = engine.core.model_executor.driver_worker.model_runner
    assert len(runner.kv_caches) == 2  # tensors shared by one layer of each group
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        engine.add_request(str(i), {"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n))
    outs, most_full = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        for r in engine.core.scheduler.running:
            full, *local = kv.get_num_blocks_by_group(r.request_id)
            if r.num_computed_tokens > r.num_prompt_tokens:  # decoding
                assert max(local) <= 3, (r.request_id, r.num_computed_tokens, local)
                assert full == -(r.num_computed_tokens // -4)
                most_full = max(most_full, full)
    assert most_full == -((20 + LONG_TOKENS - 1) // -4)  # the long request reached its end in full
    assert engine.num_preemptions > 0
    assert engine.core.scheduler.num_swaps == (engine.num_preemptions if mode == "swap" else 0)
    _assert_equal([outs[str(i)] for i in range(5)], refs, "gemma3 kv cache groups")
    for _ in range(2):  # the first pass caches the prompt (the long generation evicted it)
        again = llm.generate([{"prompt_token_ids": prompts[3]}], GREEDY, use_tqdm=False)
    assert again[0].num_cached_tokens == 60  # the last prompt token is always computed
    _assert_equal(again, refs[3:4], "gemma3 kv cache groups, prefix cache")
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_blocks - 1
    assert len(kv.free_cpu_blocks) == (127 if mode == "swap" else 0) and not kv.req_to_cpu_blocks


def test_several_groups_refuse_what_reads_one_block_table(gemma_groups_dir):
    """P/D transfer and a self-draft move / reuse one block table's K/V: refused for a hybrid
    model rather than run on group 0's table only."""
    from pagedllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="several KV cache groups"):
        EngineArgs(
            model=str(gemma_groups_dir),
            speculative_config={"method": "draft_model", "model": "self:1", "num_speculative_tokens": 2},
        ).create_engine_config()
    with pytest.raises(ValueError, match="several KV cache groups"):
        EngineArgs(
            model=str(gemma_groups_dir), kv_transfer_config={"kv_connector": "ZmqConnector", "kv_role": "kv_producer"}
        ).create_engine_config()
