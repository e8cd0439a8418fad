"""Prefix caching for models with recurrent layers (state snapshots at block boundaries), at the
default block size (16): a prompt that repeats an earlier one's first blocks resumes from the
state kept at their last boundary, and its greedy tokens equal transformers' (no cache) and the
same engine's with prefix caching off. The hits are the engine's prefix-cache counters."""

import pytest
from engine.test_greedy_equality import assert_greedy_equal
from models.hybrid_utils import GREEDY, make_hf_model, prompts
from models.test_lfm2 import CONFIG as LFM2_CONFIG
from models.test_mamba2 import CONFIG as MAMBA2_CONFIG
from models.test_qwen3_next import CONFIG as QWEN3_NEXT_CONFIG
from models.test_qwen3 import hf_reference

from pagedllm import LLM


def build(kind, path):
    if kind == "mamba2":
        from transformers import Mamba2Config, Mamba2ForCausalLM

        return make_hf_model(path, Mamba2Config, Mamba2ForCausalLM, **MAMBA2_CONFIG)
    if kind == "lfm2":
        from transformers import Lfm2Config, Lfm2ForCausalLM

        return make_hf_model(path, Lfm2Config, Lfm2ForCausalLM, **LFM2_CONFIG)
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = {k: v for k, v in QWEN3_NEXT_CONFIG.items() if "expert" not in k}
    return make_hf_model(path, Qwen3_5TextConfig, Qwen3_5ForCausalLM, **config)


def one_by_one(llm, ids):
    """Each prompt after the one before has finished -> outputs, the manager's hits after each."""
    manager = llm.llm_engine.core.scheduler.kv_cache_manager
    outs, hits = [], []
    for p in ids:
        outs += llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)
        hits.append(manager.stats.hits)
    assert manager.num_free_blocks() == manager.block_pool.num_blocks - 1  # nothing left held
    return outs, hits


@pytest.mark.parametrize("kind", ["mamba2", "lfm2", "qwen3_5"])
def test_prompts_resume_from_state_snapshots(tmp_path, kind):
    """A 47-token prompt runs whole (it shares nothing) and keeps its state at 48 as it decodes;
    its first 35 tokens part from it after 2 blocks, so run 0 -> 32 (state kept), 32 -> 35; the
    prompt plus 20 more tokens then hits 32 tokens, a chat's next turn (the prompt, the answer,
    more) 48, one sharing 10 tokens (no whole block) nothing, and the 35 tokens again 32 (3
    computed from the snapshot before the first sample: a wrong state shows)."""
    model_dir, model = build(kind, tmp_path)
    first, more, other = prompts([47, 20, 30])
    llm = LLM(model_dir, enable_prefix_caching=True)
    assert llm.llm_engine.config.cache_config.block_size == 16
    outs, hits = one_by_one(llm, [first, first[:35]])
    answer = list(outs[0].outputs[0].token_ids)
    ids = [first, first[:35], first + more, first + answer + more, first[:10] + other, first[:35]]
    more_outs, more_hits = one_by_one(llm, ids[2:])
    outs, hits = outs + more_outs, hits + more_hits
    assert hits == [0, 0, 32, 80, 80, 112]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 32, 48, 0, 32]
    assert_greedy_equal(outs, hf_reference(model, ids), f"{kind} prefix hit")
    plain, _ = one_by_one(LLM(model_dir, enable_prefix_caching=False), ids)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]


@pytest.mark.parametrize("kind", ["lfm2", "qwen3_5"])
def test_a_shared_system_prompt_hits_from_the_third_request(tmp_path, kind):
    """A 40-token system prompt and three different questions. The first request runs whole
    (nothing shared); the second finds the first's attention blocks for 32 tokens but no state
    there, so it computes from 0 and ends a chunk at 32, keeping its state; the third hits 32
    tokens (2 blocks)."""
    model_dir, model = build(kind, tmp_path)
    system, *questions = prompts([40, 20, 25, 30])
    ids = [system + q for q in questions]
    refs = hf_reference(model, ids)
    outs, hits = one_by_one(LLM(model_dir, enable_prefix_caching=True), ids)
    assert hits == [0, 0, 32]
    assert_greedy_equal(outs, refs, f"{kind} shared system prompt")


def test_a_hit_inside_a_batch_with_chunked_prefill(tmp_path):
    """Requests at once under a 16-token budget (chunks of one block): every boundary of each
    prompt is a chunk end, so a prompt submitted after the first's prefill has gone past its
    blocks hits; all equal transformers', and nothing is left held."""
    model_dir, model = build("lfm2", tmp_path)
    base, a, b = prompts([50, 9, 13])
    ids = [base + a, base + b]
    refs = hf_reference(model, ids)
    llm = LLM(model_dir, enable_prefix_caching=True, max_num_batched_tokens=16, max_num_seqs=4)
    outs, hits = one_by_one(llm, ids)
    assert hits == [0, 48]
    assert_greedy_equal(outs, refs, "lfm2 hit with 16-token chunks")
