"""--kv-cache-dtype end to end: the engine with an int8 / fp8 KV cache, or a float32 model's
bfloat16 cache, against transformers on the same weights, whose attention sees the same K/V
(an attention function registered with transformers' AttentionInterface rounds each token's
rotated key and value rows per head by the scheme written out here from its definition: scale
= max|row| / QMAX, int8 rounded half away from zero, fp8 by torch's cast; bfloat16 by torch's
cast to nearest even; then runs its SDPA). Greedy must be equal token for token up to
numerical ties; the memory planner must give more blocks."""

import pytest
import torch
from greedy_utils import assert_greedy_equal, hf_greedy

MAX_TOKENS = 12
# The cache's element type and the largest magnitude it holds (int8: 127; e4m3: 448; e5m2: 57344).
KV = {"int8": (torch.int8, 127.0), "fp8_e4m3": (torch.float8_e4m3fn, 448.0), "fp8_e5m2": (torch.float8_e5m2, 57344.0)}
D = 32  # random:tiny's head_dim
# Blocks the same memory holds, against the float32 cache's: (4 D) / (D + 4) with a float32 scale
# per row; 2 for bfloat16.
BLOCK_RATIO = {"int8": 4 * D / (D + 4), "fp8_e4m3": 4 * D / (D + 4), "fp8_e5m2": 4 * D / (D + 4), "bfloat16": 2.0}


def round_trip(x: torch.Tensor, kv: str) -> torch.Tensor:
    """x [..., D] -> each row quantized with its own scale (bfloat16: each value rounded) and
    back, in x's dtype."""
    if kv == "bfloat16":
        return x.to(torch.bfloat16).to(x.dtype)
    dtype, qmax = KV[kv]
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / qmax).clamp_min(1e-12)
    y = xf / scale
    if dtype == torch.int8:
        q = (torch.sign(y) * torch.floor(y.abs() + 0.5)).clamp(-127, 127)
    else:
        q = y.to(dtype).float()
    return (q * scale).to(x.dtype)


def _register_fake_quant(kv: str) -> str:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def fake_quant_sdpa(module, query, key, value, attention_mask, **kwargs):
        # key / value [B, Hkv, T, D]: one scale per (token, head) row, as the cache stores them
        return sdpa_attention_forward(
            module, query, round_trip(key, kv), round_trip(value, kv), attention_mask, **kwargs
        )

    name = f"kvq_{kv}"
    AttentionInterface.register(name, fake_quant_sdpa)
    return name


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3", "fp8_e5m2", "bfloat16"])
def test_engine_greedy_equals_transformers_on_quantized_kv(kv):
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams
    from pagedllm.models.random_model import random_model_dir

    path = str(random_model_dir("random:tiny"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 40, 23, 70)]
    # block 16, a budget of 32 tokens: chunked prefills with cached past, decodes beside them
    llm = LLM(path, kv_cache_dtype=kv, max_num_batched_tokens=32, max_model_len=256, kv_cache_memory=2**20)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    blocks_quant = llm.llm_engine.core.num_blocks
    del llm
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation=_register_fake_quant(kv))
    assert_greedy_equal(outs, hf_greedy(hf.eval(), prompts, MAX_TOKENS), f"kv {kv}")
    blocks_auto = LLM(path, max_model_len=256, kv_cache_memory=2**20).llm_engine.core.num_blocks
    assert blocks_quant / blocks_auto == pytest.approx(BLOCK_RATIO[kv], rel=0.02)


def test_bad_kv_cache_dtype_is_a_value_error():
    from pagedllm import LLM

    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM("random:tiny", kv_cache_dtype="int4")


def test_a_bfloat16_cache_is_refused_where_nothing_reads_it():
    """A float16 model's bfloat16 cache (no kernel reads it), by name, before anything runs."""
    from pagedllm import LLM

    with pytest.raises(ValueError, match="kv_cache_dtype bfloat16 takes a bfloat16 model"):
        LLM("random:tiny", dtype="float16", kv_cache_dtype="bfloat16")
