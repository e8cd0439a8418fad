"""DeepSeek-V3 (models/deepseek_v3.py: MLA + DeepSeekMoE) on a tiny random DeepseekV3ForCausalLM
made here with transformers' own class: greedy output equal to transformers' generate, token for token, under
chunked prefill with small blocks and a prefix-cache hit; and the MLA cache holds only the
latent and the RoPE key (its shape and bytes per token, against the MHA equivalent)."""

import pytest
import torch

from pagedllm import LLM, SamplingParams

MAX_TOKENS = 12
# Small but every part: a q low rank, nope / rope / v head dims that differ, 4 heads; a dense
# first layer, then DeepSeekMoE (8 routed experts in 4 groups, 2 groups kept, top 3, a shared
# expert, scaled weights).
TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=24,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    max_position_embeddings=256,
    initializer_range=0.1,
)


def make_deepseek_dir(out, seed: int = 0, **overrides):
    """A DeepseekV3ForCausalLM with random weights (seed), saved with a word-level tokenizer."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from pagedllm.models.random_model import BOS, EOS, UNK, _write_tokenizer

    cfg = DeepseekV3Config(
        **{**TINY, **overrides}, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=UNK, dtype=torch.float32
    )
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).float().eval()
    with torch.no_grad():  # transformers starts the correction bias at 0: make it choose
        for layer in model.model.layers[cfg.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    model.save_pretrained(out, safe_serialization=True)
    _write_tokenizer(out, cfg.vocab_size)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepseek-v3-tiny")
    return out, make_deepseek_dir(out)


def prompts_with_shared_prefix():
    g = torch.Generator().manual_seed(1)
    base = torch.randint(3, TINY["vocab_size"], (40,), generator=g).tolist()
    # The second batch reuses the first prompt's first 24 tokens (6 full blocks of 4).
    first = [base[:30], base[5:12], base[10:11]]
    second = [base[:24] + base[30:37], torch.randint(3, TINY["vocab_size"], (19,), generator=g).tolist()]
    return first, second


def hf_greedy(model, prompts):
    with torch.inference_mode():
        return [
            model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
            )[0, len(p) :].tolist()
            for p in prompts
        ]


@pytest.fixture(scope="module")
def reference(tiny):
    return [hf_greedy(tiny[1], batch) for batch in prompts_with_shared_prefix()]


def run_and_compare(llm, reference, max_tokens=MAX_TOKENS):
    """The two batches in turn (the second hits the first's cached prefix) against transformers
    (its first max_tokens tokens)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, (batch, ref) in enumerate(zip(prompts_with_shared_prefix(), reference)):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy, use_tqdm=False)
        if i == 1:
            assert outs[0].num_cached_tokens == 24, "the shared prefix should be a prefix-cache hit"
        assert [o.outputs[0].token_ids for o in outs] == [r[:max_tokens] for r in ref]


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_greedy_equals_transformers_chunked_prefix_hit(tiny, reference, backend):
    """Block size 4, a 16-token budget: prefill chunks with and without cached past, decodes
    beside them. torch: SDPA backend's metadata (gathered decode slots); cpu: by pages (both
    decompress prefills, absorb decodes); triton: every token through the latent kernel (under
    the interpreter here, on fewer tokens)."""
    llm = LLM(
        str(tiny[0]),
        device="cpu",
        block_size=4,
        max_num_batched_tokens=16,
        dtype="float32",
        attention_backend="triton" if backend == "triton" else "torch",
    )
    runner = llm.llm_engine.core.model_executor.driver_worker.model_runner
    if backend == "cpu" and runner.attn_backend.name != "cpu":
        from kernel_utils import require_built

        require_built(None)  # fails naming the build error where a compiler exists, else skips
    if backend == "torch":
        from pagedllm.attention.selector import _backend

        runner.attn_backend = _backend(runner.device, "torch")
    assert runner.attn_backend.name == backend
    # The interpreter is slow: 4 tokens still cover chunked prefill, the prefix hit and decodes.
    run_and_compare(llm, reference, 4 if backend == "triton" else MAX_TOKENS)


def test_swap_preemption_moves_latent_blocks(tiny, reference):
    """A cache too small for the batch: preempted requests' latent blocks go to the CPU swap
    space and back (the runner copies a layer's cache as the tuple its spec shapes)."""
    llm = LLM(
        str(tiny[0]),
        device="cpu",
        block_size=4,
        max_num_batched_tokens=16,
        dtype="float32",
        num_gpu_blocks=14,
        preemption_mode="swap",
        num_cpu_blocks=64,
    )
    first, _ = prompts_with_shared_prefix()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in first],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    assert llm.llm_engine.core.scheduler.num_swaps > 0
    assert [o.outputs[0].token_ids for o in outs] == reference[0]


def test_yarn_rope_equals_transformers(tmp_path):
    """DeepSeek-V3's released RoPE is yarn (factor, mscale / mscale_all_dim): the engine's
    frequencies, cos/sin attention factor and softmax mscale^2 against transformers', with
    positions past original_max_position_embeddings (16)."""
    yarn = dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=16,
        mscale=0.8,
        mscale_all_dim=1.0,
        beta_fast=32,
        beta_slow=1,
    )
    model = make_deepseek_dir(tmp_path, rope_parameters=yarn)
    first, _ = prompts_with_shared_prefix()
    llm = LLM(str(tmp_path), device="cpu", block_size=4, max_num_batched_tokens=16, dtype="float32")
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in first],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model, first)


def test_tp2_greedy_equals_transformers(tiny, reference, monkeypatch):
    """Tensor parallelism 2: each rank holds 2 of the 4 heads (q_b / kv_b column-parallel, o_proj
    row-parallel), the whole latent projections and the same latent cache, half of every
    expert's and the shared expert's intermediate columns (one all-reduce per MoE layer)."""
    monkeypatch.setenv("PAGEDLLM_WORKER_THREADS", "1")
    llm = LLM(
        str(tiny[0]), device="cpu", tensor_parallel_size=2, block_size=4, max_num_batched_tokens=16, dtype="float32"
    )
    try:
        run_and_compare(llm, reference)
    finally:
        llm.shutdown()


def test_mla_cache_is_latent(tiny):
    out, _ = tiny
    llm = LLM(str(out), device="cpu", block_size=4, num_gpu_blocks=8, dtype="float32")
    runner = llm.llm_engine.core.model_executor.driver_worker.model_runner
    R, dr, L = TINY["kv_lora_rank"], TINY["qk_rope_head_dim"], TINY["num_hidden_layers"]
    assert len(runner.kv_caches) == L
    for layer in runner.kv_caches:
        assert len(layer) == 1 and tuple(layer[0].shape) == (8 * 4, R + dr)
    bytes_per_token = runner.kv_bytes_per_block() // 4
    assert bytes_per_token == L * (R + dr) * 4
    H, dqk, dv = TINY["num_attention_heads"], TINY["qk_nope_head_dim"] + dr, TINY["v_head_dim"]
    mha = L * H * (dqk + dv) * 4
    print(
        f"MLA cache: {bytes_per_token} B/token ({L} layers x ({R}+{dr}) x 4 B); "
        f"MHA equivalent: {mha} B/token ({L} x {H} heads x ({dqk}+{dv}) x 4 B): {mha / bytes_per_token:.1f}x"
    )
    # DeepSeek-V3's own dims in bfloat16 (BENCHMARKS.md): 61 layers, kv_lora_rank 512, rope 64;
    # 128 heads of K 192 (128 nope + 64 rope) and V 128.
    from pagedllm.attention.kv_cache_spec import FullAttentionSpec, MLAAttentionSpec

    mla_v3 = 61 * MLAAttentionSpec(16, 512, 64, torch.bfloat16).page_size_bytes // 16
    mha_v3 = (
        61
        * (
            FullAttentionSpec(16, 128, 192, torch.bfloat16).page_size_bytes
            + FullAttentionSpec(16, 128, 128, torch.bfloat16).page_size_bytes
        )
        // 32
    )
    assert (mla_v3, mha_v3) == (70_272, 4_997_120)
    print(f"DeepSeek-V3: MLA {mla_v3} B/token vs MHA {mha_v3} B/token ({mha_v3 / mla_v3:.1f}x)")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_greedy_equals_transformers_on_gpu(tiny):
    """The CUDA path: the latent Triton kernel compiled, the grouped-expert Triton matmuls,
    decode steps replayed from CUDA graphs; against transformers on the same GPU (float32)."""
    out, model = tiny
    gpu_model = model.to("cuda")
    try:
        first, second = prompts_with_shared_prefix()
        with torch.inference_mode():
            reference = [
                [
                    r.tolist()
                    for r in (
                        gpu_model.generate(
                            torch.tensor([p], device="cuda"),
                            do_sample=False,
                            attention_mask=torch.ones(1, len(p), dtype=torch.long, device="cuda"),
                            max_new_tokens=MAX_TOKENS,
                            min_new_tokens=MAX_TOKENS,
                        )[0, len(p) :]
                        for p in batch
                    )
                ]
                for batch in (first, second)
            ]
    finally:
        model.to("cpu")
    llm = LLM(
        str(out), device="cuda", attention_backend="triton", dtype="float32", block_size=4, max_num_batched_tokens=16
    )
    runner = llm.llm_engine.core.model_executor.driver_worker.model_runner
    assert runner.graphs is not None
    run_and_compare(llm, reference)


def test_bad_mla_config_is_a_value_error():
    from pagedllm.models.deepseek_v3 import DeepseekV3ForCausalLM
    from transformers import DeepseekV3Config

    hf = DeepseekV3Config(**TINY).to_dict()
    for field, bad in (("kv_lora_rank", None), ("qk_rope_head_dim", 7), ("v_head_dim", 0)):
        with pytest.raises(ValueError, match=field):
            DeepseekV3ForCausalLM({**hf, field: bad}, 64)


def test_quantized_kv_cache_is_refused_for_mla(tiny):
    """--kv-cache-dtype int8 / fp8 is for K/V caches; MLA's latent cache refuses it clearly."""
    with pytest.raises(ValueError, match="kv_cache_dtype .* MLA"):
        LLM(str(tiny[0]), device="cpu", block_size=4, num_gpu_blocks=8, dtype="float32", kv_cache_dtype="int8")
