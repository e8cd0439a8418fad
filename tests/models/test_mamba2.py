"""Mamba2 (every layer recurrent, no attention): greedy output equal to transformers' own
Mamba2ForCausalLM on the same random weights, token for token, for a batch of mixed lengths under
chunked prefill with a small token budget (prompts cut into chunks that continue from the state
the last chunk left, across SSD chunk boundaries), and when late requests of a higher priority
preempt running ones (their state recomputed from the first token)."""

import pytest
from engine.test_greedy_equality import assert_greedy_equal
from models.hybrid_utils import (
    MAX_TOKENS,
    check_batch_against_transformers,
    check_late_arrivals_preempt,
    make_hf_model,
    prompts,
    run_with_late_arrival,
)
from models.test_qwen3 import hf_reference

from pagedllm import LLM

# conv_dim = 128 + 2 * 2 * 16 = 192; SSD chunks of 8 tokens, so a prompt spans several.
CONFIG = dict(
    hidden_size=64,
    expand=2,
    num_heads=8,
    head_dim=16,
    state_size=16,
    n_groups=2,
    conv_kernel=4,
    chunk_size=8,
    num_hidden_layers=2,
    tie_word_embeddings=False,
    use_conv_bias=True,
)


def mamba2(tmp_path):
    from transformers import Mamba2Config, Mamba2ForCausalLM

    return make_hf_model(tmp_path, Mamba2Config, Mamba2ForCausalLM, **CONFIG)


def test_mamba2_equals_transformers_batched_and_chunked(tmp_path):
    """One state group; no preemption (a request's state blocks never grow)."""
    check_batch_against_transformers(*mamba2(tmp_path), "Mamba2 chunked", ["StateManager"], 0, block_size=4)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_mamba2_state_after_preemption(tmp_path, mode):
    """Two state blocks: two early requests hold both; two late ones of a higher priority
    preempt them, and the early ones start again from a zero state (recompute) or from their
    state swapped out to CPU blocks and back into the other state block."""
    outs = check_late_arrivals_preempt(
        *mamba2(tmp_path),
        f"Mamba2 preempted ({mode})",
        block_size=4,
        num_gpu_blocks=3,
        preemption_mode=mode,
        num_cpu_blocks=8,
    )
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs.values())


def test_a_failed_step_recomputes_the_states(tmp_path, monkeypatch):
    """A late request whose steps fail (an injected fault, before the forward) is ended; the
    early ones, whose states had advanced, are rolled back with every running request and
    computed again from the first token: their tokens still equal transformers'. (A state
    left unzeroed need not change these tokens; the preemption test above catches that.)"""
    monkeypatch.setenv("PAGEDLLM_FAULT_INJECTION", "raise:2")
    model_dir, model = mamba2(tmp_path)
    early = prompts([41, 33])
    # Three state blocks, all used before the failure: the recomputed requests get used ones.
    outs, _, failed = run_with_late_arrival(
        model_dir, early, [[5, 2, 7]], block_size=4, max_num_batched_tokens=16, max_num_seqs=4, num_gpu_blocks=4
    )
    assert failed == ["l0"]
    assert_greedy_equal([outs[r] for r in ("e0", "e1")], hf_reference(model, early), "Mamba2 after a failed step")


def test_parallel_samples_fork_the_state_where_there_is_room(tmp_path):
    """n = 3 greedy samples of one prompt with two state blocks: the parent computes the prompt
    but its last token, then one sibling gets a copy of its state (the only free block) and the
    other two start over from the prompt; all three equal transformers' greedy output."""
    from pagedllm import SamplingParams

    model_dir, model = mamba2(tmp_path)
    (prompt,) = prompts([23])
    (ref,) = hf_reference(model, [prompt])
    llm = LLM(model_dir, block_size=4, max_num_batched_tokens=16, max_num_seqs=4, num_gpu_blocks=3)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [ref[0]] * 3
    manager = llm.llm_engine.core.scheduler.kv_cache_manager
    assert manager.num_free_blocks() == 2


def test_what_a_recurrent_state_cannot_do_is_refused(tmp_path, caplog):
    """Speculative decoding (no state rollback) and split models are ValueErrors before the
    model loads, a quantized KV cache once the runner sees the layers; prefix caching stays on
    (state snapshots: test_hybrid_prefix_cache.py); swap preemption moves the states."""
    from pagedllm.engine.arg_utils import EngineArgs

    model_dir, _ = mamba2(tmp_path)
    with pytest.raises(ValueError, match="speculative_config is not supported for a model with recurrent layers"):
        EngineArgs(model=model_dir, speculative_config={"method": "ngram"}).create_engine_config()
    with pytest.raises(
        ValueError, match="tensor_parallel_size and pipeline_parallel_size must be 1 for a model with recurrent layers"
    ):
        EngineArgs(model=model_dir, tensor_parallel_size=2).create_engine_config()
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto' for a model with recurrent layers"):
        LLM(model_dir, kv_cache_dtype="int8")
    llm = LLM(model_dir, enable_prefix_caching=True)
    manager = llm.llm_engine.core.scheduler.kv_cache_manager
    assert manager.enable_caching
