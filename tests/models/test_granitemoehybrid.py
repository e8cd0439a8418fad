"""Granite-4.0-H (GraniteMoeHybrid): Mamba2 layers and attention layers in one KV cache, the SSM
and conv states placed in the attention layers' K and V pages; greedy output equal to
transformers' own class on random weights, token for token, dense and with routed experts, under
chunked prefill with a small token budget and a cache small enough to preempt."""

import pytest

from models.hybrid_utils import check_batch_against_transformers, make_hf_model

# Mamba: 4 heads x 32 x d_state 8 = 1024 floats of SSM state, conv (128 + 2 x 8) x 3 = 432;
# attention: 4 KV heads x 16 a token, so a block of 16 tokens has K and V rows of 1024 floats:
# the SSM state fills the K row, the conv state fits the V row.
CONFIG = dict(
    hidden_size=64,
    intermediate_size=48,
    shared_intermediate_size=80,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=256,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"],
    mamba_n_heads=4,
    mamba_d_head=32,
    mamba_d_state=8,
    mamba_n_groups=1,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=8,
    embedding_multiplier=1.5,
    residual_multiplier=0.7,
    attention_multiplier=0.2,
    logits_scaling=2.0,
    initializer_range=0.1,
    tie_word_embeddings=False,
)


@pytest.mark.parametrize("experts, rope", [(0, "rope"), (4, None)])
def test_granite_hybrid_equals_transformers(tmp_path, experts, rope):
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    model_dir, model = make_hf_model(
        tmp_path,
        GraniteMoeHybridConfig,
        GraniteMoeHybridForCausalLM,
        **CONFIG,
        num_local_experts=experts,
        num_experts_per_tok=2,
        position_embedding_type=rope,
    )
    # The longest request holds 6 attention blocks + 2 state blocks at full length; 12 blocks
    # hold fewer than the batch.
    check_batch_against_transformers(
        model_dir,
        model,
        f"Granite-4.0-H experts={experts} rope={rope}",
        ["FullAttentionManager", "StateManager", "StateManager"],
        1,
        block_size=16,
        num_gpu_blocks=12,
    )
