"""A draft model from an HF directory (spec_decode/draft_dir_proposer.py): its own paged KV cache
beside the target's, caught up every step. Target random:tiny (a transformers LlamaForCausalLM
with random weights); drafts from
- a 1-layer random Llama with the same vocabulary (drafts mostly rejected), and
- the target's own directory: a draft that computes what the target computes must propose the
  target's greedy continuation, so nearly every draft is accepted; this fails if the draft's
  cache misses or misplaces a position (prefill chunks, accepted spans, rollbacks).
Greedy output equals transformers' token for token with chunked prefill and preemption forced,
and no block is left in use. A draft with another vocabulary is a ValueError naming vocab_size;
"model" without "method" means a draft model (vLLM)."""

import pytest
import torch
from greedy_utils import assert_greedy_equal, hf_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.config import SpeculativeConfig
from pagedllm.models.random_model import random_model_dir

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 9, 30, 31, 32, 33, 34], [9, 10, 11, 12, 13, 9, 10], [40, 41] * 5]
MAX_TOKENS = 24


def make_draft_dir(out, vocab_size=512, seed=3):
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedllm.models.random_model import _write_tokenizer

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).float().save_pretrained(out, safe_serialization=True)
    _write_tokenizer(out, vocab_size)
    return str(out)


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(random_model_dir("random:tiny"))
    return hf_greedy(model, PROMPTS, MAX_TOKENS, min_new_tokens=MAX_TOKENS)


@pytest.mark.parametrize("draft", ["small", "target"])
def test_greedy_with_a_draft_directory_equals_transformers(tmp_path, reference, draft):
    path = make_draft_dir(tmp_path) if draft == "small" else str(random_model_dir("random:tiny"))
    llm = LLM(
        "random:tiny",
        max_model_len=128,
        block_size=4,
        num_gpu_blocks=16,
        max_num_batched_tokens=10,
        speculative_config={"model": path, "num_speculative_tokens": 3},
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    core = llm.llm_engine.core
    stats = core.scheduler.spec_decoding_stats
    assert llm.llm_engine.num_preemptions > 0, "the small cache should have forced preemption"
    assert_greedy_equal(outs, reference, f"draft {draft}, {stats}")
    if draft == "target":
        assert stats.num_draft_tokens > 20 and stats.acceptance_rate > 0.9, stats
    else:
        assert stats.num_draft_tokens > 20 and stats.acceptance_rate < 0.5, stats
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1, "a KV block leaked"


def test_draft_with_another_vocabulary_is_refused(tmp_path):
    path = make_draft_dir(tmp_path, vocab_size=320)
    assert SpeculativeConfig.from_dict({"model": path}).method == "draft_model"
    with pytest.raises(ValueError, match="vocab_size"):
        LLM("random:tiny", speculative_config={"model": path, "num_speculative_tokens": 2})
