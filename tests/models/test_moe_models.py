"""Mixtral and Qwen3-MoE: greedy output equal to transformers' generate on the same random
weights, token for token, under chunked prefill with small blocks; Qwen3-MoE also split over
two tensor-parallel processes (each holding half of every expert's intermediate columns, an
uneven 12 / 13). The helpers are test_qwen3.py's."""

import pytest

from models.test_qwen3 import (
    CHUNKED,
    assert_greedy_equal,
    check_against_transformers,
    hf_reference,
    prompts,
    run_engine,
)

# 8 experts, 2 per token; a router drawn wide enough that routing is no coin toss.
MOE = dict(num_experts_per_tok=2, initializer_range=0.2)


def test_mixtral_equals_transformers(tmp_path):
    from transformers import MixtralConfig, MixtralForCausalLM

    check_against_transformers(
        tmp_path, MixtralConfig, MixtralForCausalLM, "Mixtral", num_local_experts=8, intermediate_size=40, **MOE
    )


def qwen3_moe(tmp_path, **overrides):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    # Layer 1 is dense (mlp_only_layers); layers 0 and 2 are sparse.
    return check_against_transformers(
        tmp_path,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        "Qwen3-MoE",
        num_experts=8,
        moe_intermediate_size=25,
        num_hidden_layers=3,
        mlp_only_layers=[1],
        head_dim=16,
        **MOE,
        **overrides,
    )


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_qwen3_moe_equals_transformers(tmp_path, norm_topk_prob):
    model_dir, model = qwen3_moe(tmp_path, norm_topk_prob=norm_topk_prob)
    from pagedllm.models.layers.fused_moe import FusedMoE
    from pagedllm.models.llama import LlamaMLP
    from pagedllm.models.loader import load_model
    from pagedllm.models.model_config_loader import model_config_from_dir

    ours = load_model(model_config_from_dir(model_dir, max_model_len=64))
    kinds = [type(layer.mlp.experts if hasattr(layer.mlp, "experts") else layer.mlp) for layer in ours.layers]
    assert kinds == [FusedMoE, LlamaMLP, FusedMoE]
    assert ours.layers[0].mlp.experts.renormalize is norm_topk_prob


def test_qwen3_moe_tp2_equals_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_WORKER_THREADS", "1")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from models.test_qwen3 import make_hf_model

    model_dir, model = make_hf_model(
        tmp_path,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        num_experts=8,
        moe_intermediate_size=25,
        num_hidden_layers=3,
        mlp_only_layers=[1],
        head_dim=16,
        **MOE,
    )
    ids = prompts()
    outs = run_engine(model_dir, ids, tensor_parallel_size=2, **CHUNKED)
    assert_greedy_equal(outs, hf_reference(model, ids), "Qwen3-MoE TP=2")
