"""LFM2, a hybrid of gated short convolutions and full attention: greedy output equal to
transformers' own Lfm2ForCausalLM on the same random weights, token for token, with the
attention group and the conv-state groups in one KV cache: a batch of mixed lengths under
chunked prefill with a small token budget and a cache small enough that running requests are
preempted (their attention blocks and states recomputed), and late requests of a higher
priority preempting running ones."""

import pytest

from models.hybrid_utils import check_batch_against_transformers, check_late_arrivals_preempt, make_hf_model

from pagedllm import LLM
from pagedllm.models.layers.mamba.state_layer import state_layers

# Layers conv, attention, conv, conv, attention, conv: 2 attention layers, so 4 conv layers in
# 2 state groups of 2; the MLP's width 144 -> int(2 * 144 / 3) = 96 (a multiple of 32).
CONFIG = dict(
    hidden_size=64,
    intermediate_size=144,
    block_multiple_of=32,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    conv_L_cache=3,
    layer_types=["conv", "full_attention", "conv", "conv", "full_attention", "conv"],
    initializer_range=0.1,
)


def lfm2(tmp_path, **overrides):
    from transformers import Lfm2Config, Lfm2ForCausalLM

    return make_hf_model(tmp_path, Lfm2Config, Lfm2ForCausalLM, **{**CONFIG, **overrides})


@pytest.mark.parametrize("conv_bias", [False, True])
def test_lfm2_equals_transformers_chunked_and_preempted(tmp_path, conv_bias):
    # Blocks of 4 tokens: an attention page is 4 x 2 heads x 16 x (K, V) floats, a conv state
    # 64 x 2 floats fits its K half. 26 blocks: the longest request needs 21 + 2 x 1 at full
    # length, the batch far more.
    check_batch_against_transformers(
        *lfm2(tmp_path, conv_bias=conv_bias),
        f"LFM2 chunked, conv_bias={conv_bias}",
        ["FullAttentionManager", "StateManager", "StateManager"],
        1,
        block_size=4,
        num_gpu_blocks=26,
    )


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_lfm2_late_requests_preempt_running_ones(tmp_path, mode):
    """Swap: the attention blocks and both state groups' blocks go to the CPU and come back."""
    check_late_arrivals_preempt(
        *lfm2(tmp_path),
        f"LFM2 preempted ({mode})",
        block_size=4,
        num_gpu_blocks=24,
        preemption_mode=mode,
        num_cpu_blocks=64,
    )


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_conv_state_over_two_blocks(tmp_path, mode):
    """Blocks of 1 token: an attention page is a K and a V row of 2 heads x 16 = 32 floats, so a
    conv state of 64 x 2 floats is laid over the K and V rows of 2 blocks, which each request
    holds in each state group; greedy still equals transformers, preempted both ways."""
    model_dir, model = lfm2(tmp_path)
    outs = check_late_arrivals_preempt(
        model_dir,
        model,
        f"LFM2, states over 2 blocks ({mode})",
        block_size=1,
        num_gpu_blocks=120,
        preemption_mode=mode,
        num_cpu_blocks=256,
    )
    assert len(outs) == 4
    llm = LLM(model_dir, block_size=1, num_gpu_blocks=20)
    assert [g.state_blocks for g in llm.llm_engine.core.kv_cache_config.kv_cache_groups] == [None, 2, 2]
    layers = state_layers(llm.llm_engine.core.model_executor.driver_worker.model_runner.model).values()
    assert all(layer.state is None and layer.pages.num_blocks == 2 for layer in layers)


def test_conv_states_are_views_of_the_attention_pages(tmp_path):
    """Each conv layer's state is a [num_blocks, 64, 2] view into the K tensor of its slot:
    writing request r's state writes block r's page, the one the attention groups also use."""
    model_dir, _ = lfm2(tmp_path)
    llm = LLM(model_dir, block_size=4, num_gpu_blocks=10)
    runner = llm.llm_engine.core.model_executor.driver_worker.model_runner
    layers = list(state_layers(runner.model).values())
    assert [(lay.kv_cache_group_id, lay.kv_cache_tensor_id) for lay in layers] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    for layer in layers:
        k = runner.kv_caches[layer.kv_cache_tensor_id][0]  # [10 * 4, 2, 16]
        (state,) = layer.state
        assert state.shape == (10, 64, 2) and state.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
        state[7] = 1.0
        assert k.view(10, -1)[7, :128].eq(1.0).all() and k.view(10, -1)[6].eq(0).all()
        state.zero_()
