"""Qwen3-Next and Qwen3.5 (text): Gated DeltaNet layers and gated attention layers in one KV cache, the conv and
delta-rule states placed in the attention layers' K and V pages; greedy output equal to
transformers' own class on random weights, token for token, with sparse MoE layers (shared
expert) and dense ones, under chunked prefill with a small token budget and a cache small
enough to preempt."""

import pytest

from models.hybrid_utils import check_batch_against_transformers, check_late_arrivals_preempt, make_hf_model

# Gated DeltaNet: 2 key heads x 16 serving 4 value heads x 16: a delta-rule state of
# 4 x 16 x 16 = 1024 floats, a conv state of (2 x 32 + 64) x 3 = 384; attention: 4 KV heads x 16
# a token, so a block of 16 tokens has K and V rows of 1024 floats: the delta-rule state fills
# the K row, the conv state fits the V row.
CONFIG = dict(
    hidden_size=64,
    intermediate_size=48,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=40,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=16,
    max_position_embeddings=256,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    initializer_range=0.1,
    tie_word_embeddings=False,
)


@pytest.mark.parametrize(
    "sparse_step, mlp_only",
    [(1, [2]), (2, []), (1, [0, 1, 2, 3, 4])],
    ids=["moe-and-dense", "every-second-moe", "dense"],
)
def test_qwen3_next_equals_transformers(tmp_path, sparse_step, mlp_only):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    model_dir, model = make_hf_model(
        tmp_path,
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
        **CONFIG,
        decoder_sparse_step=sparse_step,
        mlp_only_layers=mlp_only,
    )
    # The longest request holds 6 attention blocks + 2 state blocks at full length; 12 blocks
    # hold fewer than the batch.
    check_batch_against_transformers(
        model_dir,
        model,
        f"Qwen3-Next sparse_step={sparse_step} dense={mlp_only}",
        ["FullAttentionManager", "StateManager", "StateManager"],
        1,
        block_size=16,
        num_gpu_blocks=12,
    )


def test_qwen3_5_text_equals_transformers(tmp_path):
    """Qwen3.5's text model: the same layers, a dense MLP each, the Gated DeltaNet's
    projections as separate matrices."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = {k: v for k, v in CONFIG.items() if "expert" not in k}
    model_dir, model = make_hf_model(tmp_path, Qwen3_5TextConfig, Qwen3_5ForCausalLM, **config)
    check_batch_against_transformers(
        model_dir,
        model,
        "Qwen3.5 text",
        ["FullAttentionManager", "StateManager", "StateManager"],
        1,
        block_size=16,
        num_gpu_blocks=12,
    )


def qwen3_next(tmp_path, **overrides):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    return make_hf_model(tmp_path, Qwen3NextConfig, Qwen3NextForCausalLM, **{**CONFIG, **overrides})


def test_qwen3_next_late_requests_preempt_running_ones(tmp_path):
    """Running requests preempted mid-decode restart from a zero state and recompute it."""
    check_late_arrivals_preempt(*qwen3_next(tmp_path), "Qwen3-Next preempted", block_size=16, num_gpu_blocks=10)


def test_qwen3_5_late_requests_swapped_out_and_in(tmp_path):
    """Preempted by swap, a request's attention blocks and its conv and delta-rule states (in
    the attention pages of other blocks) go to CPU blocks and come back: it resumes from them."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = {k: v for k, v in CONFIG.items() if "expert" not in k}
    model_dir, model = make_hf_model(tmp_path, Qwen3_5TextConfig, Qwen3_5ForCausalLM, **config)
    check_late_arrivals_preempt(
        model_dir, model, "Qwen3.5 swapped", block_size=16, num_gpu_blocks=10, preemption_mode="swap", num_cpu_blocks=32
    )


def test_qwen3_5_states_over_three_blocks(tmp_path):
    """Blocks of 4 tokens: a page is a K and a V row of 4 x 4 heads x 16 = 256 floats, so the
    delta-rule state (4 x 16 x 16 = 1024 floats) and the conv state (384) are laid over 3
    blocks' pages (1408 <= 3 x 512), the delta-rule state straddling rows: a batch under chunked
    prefill, preempted, equal to transformers."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    from pagedllm.models.layers.mamba.state_layer import state_layers

    config = {k: v for k, v in CONFIG.items() if "expert" not in k}
    model_dir, model = make_hf_model(tmp_path, Qwen3_5TextConfig, Qwen3_5ForCausalLM, **config)
    llm = check_batch_against_transformers(
        model_dir,
        model,
        "Qwen3.5 text, states over 3 blocks",
        ["FullAttentionManager", "StateManager", "StateManager"],
        1,
        block_size=4,
        num_gpu_blocks=40,
    )
    assert [g.state_blocks for g in llm.llm_engine.core.kv_cache_config.kv_cache_groups] == [None, 3, 3]
    layers = state_layers(llm.llm_engine.core.model_executor.driver_worker.model_runner.model).values()
    assert all(layer.state is None and layer.pages.num_blocks == 3 for layer in layers)


def test_bad_layer_types_are_refused():
    from pagedllm.models.qwen3_next import Qwen3NextForCausalLM

    hf = {
        **CONFIG,
        "vocab_size": 256,
        "layer_types": ["linear_attention", "mamba", "full_attention", "full_attention", "full_attention"],
    }
    with pytest.raises(ValueError, match="layer_types must list one of"):
        Qwen3NextForCausalLM(hf, 256)
