"""Mamba2 (every layer recurrent, no attention): greedy output equal to transformers' own
Mamba2ForCausalLM on the same random weights, token for token, for a batch of mixed lengths under
chunked prefill with a small token budget (prompts cut into chunks that continue from the state
the last chunk left, across SSD chunk boundaries), and when late requests of a higher priority
preempt running ones (their state recomputed from the first token)."""
from engine.test_greedy_equality import assert_greedy_equal
from models.hybrid_utils import GREEDY, MAX_TOKENS, make_hf_model, prompts, run_with_late_arrival
from models.test_qwen3 import hf_reference

from pagedllm import LLM

LENGTHS = [1, 6, 19, 41, 70]
# conv_dim = 128 + 2 * 2 * 16 = 192; SSD chunks of 8 tokens, so a prompt spans several.
CONFIG = dict(hidden_size=64, expand=2, num_heads=8, head_dim=16, state_size=16, n_groups=2, conv_kernel=4,
              chunk_size=8, num_hidden_layers=2, tie_word_embeddings=False, use_conv_bias=True)


def mamba2(tmp_path):
    from transformers import Mamba2Config, Mamba2ForCausalLM
    return make_hf_model(tmp_path, Mamba2Config, Mamba2ForCausalLM, **CONFIG)


def test_mamba2_equals_transformers_batched_and_chunked(tmp_path):
    model_dir, model = mamba2(tmp_path)
    ids = prompts(LENGTHS)
    refs = hf_reference(model, ids)
    llm = LLM(model_dir, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    manager = llm.llm_engine.core.scheduler.kv_cache_manager
    assert [type(m).__name__ for m in manager.managers] == ["StateManager"] and not manager.enable_caching
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], GREEDY, use_tqdm=False)
    assert_greedy_equal(outs, refs, "Mamba2 chunked")
    assert manager.num_free_blocks() == manager.block_pool.num_blocks - 1   # every state block back


def test_mamba2_state_recomputed_after_preemption(tmp_path):
    """Two state blocks: two early requests hold both; two late ones of a higher priority
    preempt them, and the early ones start again from a zero state."""
    model_dir, model = mamba2(tmp_path)
    early, late = prompts([41, 33]), prompts([19, 6])
    outs, preemptions = run_with_late_arrival(model_dir, early, late, block_size=4, max_num_batched_tokens=16,
                                              max_num_seqs=4, num_gpu_blocks=3)
    assert preemptions > 0
    refs = hf_reference(model, early + late)
    assert_greedy_equal([outs[r] for r in ("e0", "e1", "l0", "l1")], refs, "Mamba2 preempted")
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs.values())
