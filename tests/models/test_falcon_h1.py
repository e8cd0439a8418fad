"""Falcon-H1: attention and a Mamba2 mixer side by side in every layer, muP multipliers
everywhere; greedy output equal to transformers' own FalconH1ForCausalLM on random weights,
token for token, for a batch of mixed lengths under chunked prefill with a small token budget
and a cache small enough to preempt (by recompute and by swap), with the mixer's norm options."""

import pytest

from models.hybrid_utils import check_batch_against_transformers, check_late_arrivals_preempt, make_hf_model

# Attention: 4 heads x 16, 2 KV heads; mixer: 8 heads x 8 (mamba_d_ssm 64), 1 group, d_state 16:
# conv state (64 + 32) x 3, SSM state 8 x 8 x 16 = 1024 floats; an attention page at block_size 8
# is a K and a V row of 8 x 2 x 16 = 256 floats, so the states span 3 blocks (1312 <= 1536).
CONFIG = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    mamba_d_ssm=64,
    mamba_n_heads=8,
    mamba_d_head=8,
    mamba_n_groups=1,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_chunk_size=8,
    mamba_conv_bias=True,
    mamba_proj_bias=True,
    projectors_bias=False,
    tie_word_embeddings=False,
    initializer_range=0.1,
    # muP multipliers away from 1, so that a missing one shows
    embedding_multiplier=1.5,
    lm_head_multiplier=0.7,
    attention_in_multiplier=0.8,
    attention_out_multiplier=1.3,
    ssm_in_multiplier=1.2,
    ssm_out_multiplier=0.9,
    key_multiplier=1.4,
    mlp_multipliers=[0.6, 1.25],
    ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3],
)


def falcon_h1(tmp_path, **overrides):
    from transformers import FalconH1Config, FalconH1ForCausalLM

    return make_hf_model(tmp_path, FalconH1Config, FalconH1ForCausalLM, **{**CONFIG, **overrides})


@pytest.mark.parametrize(
    "rms_norm, before_gate",
    [(True, True), (True, False), (False, True)],
    ids=["norm-then-gate", "gate-then-norm", "gate-only"],
)
def test_falcon_h1_equals_transformers(tmp_path, rms_norm, before_gate):
    model_dir, model = falcon_h1(tmp_path, mamba_rms_norm=rms_norm, mamba_norm_before_gate=before_gate)
    llm = check_batch_against_transformers(
        model_dir,
        model,
        f"Falcon-H1 rms_norm={rms_norm} before={before_gate}",
        ["FullAttentionManager", "StateManager"],
        1,
        block_size=8,
        num_gpu_blocks=24,
    )
    assert [g.state_blocks for g in llm.llm_engine.core.kv_cache_config.kv_cache_groups] == [None, 3]


def test_falcon_h1_late_requests_swapped_out_and_in(tmp_path):
    check_late_arrivals_preempt(
        *falcon_h1(tmp_path, mamba_rms_norm=True),
        "Falcon-H1 swapped",
        block_size=8,
        num_gpu_blocks=20,
        preemption_mode="swap",
        num_cpu_blocks=64,
    )


def test_falcon_h1_is_known_as_recurrent(tmp_path):
    """Its config's layer_types say "hybrid": the model type marks it as holding a state, so
    what a state cannot do is refused before the model loads."""
    from pagedllm.engine.arg_utils import EngineArgs

    model_dir, _ = falcon_h1(tmp_path)
    with pytest.raises(ValueError, match="speculative_config is not supported for a model with recurrent layers"):
        EngineArgs(model=model_dir, speculative_config={"method": "ngram"}).create_engine_config()
