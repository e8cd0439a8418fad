"""Greedy output equals transformers' generate(do_sample=False) on the same directory, token for
token, for default settings, chunked prefill with tiny blocks, and a KV cache small enough
to force preemption, one copy of the CPU linears' weights, and with speculative decoding (n-gram drafts; the default model's first 16
layers as its draft model) under chunked prefill and preemption. The one allowed difference is
a numerical tie (DESIGN.md): where the two first differ, the reference's top-2 logits are
within 1e-4."""

import pytest
from greedy_utils import assert_greedy_equal, hf_greedy_batched

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.model

MAX_TOKENS = 64
PROMPT_LENGTHS = [1, 2, 5, 9, 17, 31, 48, 64, 77, 100, 129, 160, 199, 231, 270, 300]

TEXT = """
The lighthouse keeper woke before dawn, as he had every day for thirty years, and climbed the
spiral stairs with a lantern in one hand and a mug of bitter coffee in the other. Outside, the
sea was the colour of wet slate. Gulls argued on the rocks below. He checked the lamp, wiped the
great lens with a soft cloth, and wrote the date in the logbook in small careful letters.
In the town across the bay, the baker was already pulling loaves from the oven. Her daughter,
who was nine and wanted to be an astronomer, sat at the kitchen table drawing the orbits of the
planets on the back of a flour sack. Mercury was a tight little circle; Neptune ran off the edge.
"Space is mostly empty," she announced. "That is why it is so big." Her mother laughed and said
that the same was true of most arguments. A train whistled somewhere inland.
Meanwhile, a committee of the regional council was debating whether to replace the lighthouse
with an automatic beacon. The engineer presented a spreadsheet showing that the beacon would cost
less over twenty years, require no keeper, and never fall asleep. A fisherman in the public
gallery stood up and asked who would notice a boat in trouble on a foggy night, and whether a
spreadsheet had ever carried anyone home. Nobody answered him, but the vote was postponed.
Photosynthesis converts light energy into chemical energy: chlorophyll absorbs mostly red and
blue light, water molecules are split, oxygen is released, and carbon dioxide is fixed into
sugars through the Calvin cycle. In 1905, Albert Einstein published four papers that changed
physics; one explained the photoelectric effect, another special relativity. def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
The keeper, who knew nothing of the committee, fed his cat and watched the tide turn.
"""


def greedy_equality_prompts(tokenizer) -> list[list[int]]:
    """Windows of different lengths from different places in the text (token ids); also the
    quantized weights' agreement prompts (tests/models/test_quantization.py)."""
    ids = tokenizer(TEXT)["input_ids"]
    assert len(ids) >= 340
    return [ids[(7 * i) % (len(ids) - n) :][:n] for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="session")
def prompts(tokenizer):
    return greedy_equality_prompts(tokenizer)


@pytest.fixture(scope="session")
def reference(hf_model, prompts):
    """transformers greedy: (output token ids, top-2 logit gap at each step) per prompt, the 16
    prompts in one batch."""
    return hf_greedy_batched(hf_model, prompts, MAX_TOKENS)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def test_default_settings(model_dir, prompts, reference):
    llm = LLM(model_dir)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_greedy_equal(outs, reference, "default")


def test_one_weight_copy(model_dir, prompts, reference, monkeypatch):
    """The CPU's float linears with one copy of their weights (PAGEDLLM_CPU_WEIGHT_COPIES=1, as
    where two do not fit: models/layers/weight_copies.py): oneDNN's packed linear at every row
    count, decode steps of 16 rows down to 1 through the C++ decode loop."""
    monkeypatch.setenv("PAGEDLLM_CPU_WEIGHT_COPIES", "1")
    llm = LLM(model_dir)
    runner = llm.llm_engine.core.model_executor.driver_worker.model_runner
    assert runner.decode_loop is not None
    qkv = runner.model.layers[0].self_attn.qkv_proj
    assert qkv.linear_method.one_copy and qkv.weight is None
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_greedy_equal(outs, reference, "one weight copy")


def test_chunked_prefill_small_blocks(model_dir, prompts, reference):
    llm = LLM(model_dir, block_size=4, max_num_batched_tokens=32)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_greedy_equal(outs, reference, "block_size=4, budget=32")


def test_preemption(model_dir, prompts, reference):
    # 40 blocks of 16 tokens: the largest request (300 + 64 tokens) fits alone, all 16 cannot.
    llm = LLM(model_dir, num_gpu_blocks=40, max_num_batched_tokens=256)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert llm.llm_engine.num_preemptions > 0, "the small cache should have forced preemption"
    pool = llm.llm_engine.core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    assert_greedy_equal(outs, reference, f"preemption x{llm.llm_engine.num_preemptions}")


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SELF_DRAFT = {"method": "draft_model", "model": "self:16", "num_speculative_tokens": 1}


@pytest.mark.parametrize("spec, mode", [(NGRAM, "recompute"), (SELF_DRAFT, "swap")], ids=["ngram", "self16"])
def test_speculative_decoding(model_dir, prompts, reference, spec, mode):
    """Each proposer (the truncated self-draft too) with chunked prefill and preemption forced:
    the same tokens as transformers; drafts were accepted, so verification ran."""
    llm = LLM(
        model_dir,
        speculative_config=spec,
        num_gpu_blocks=40,
        max_num_batched_tokens=64,
        preemption_mode=mode,
        num_cpu_blocks=64,
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    stats = llm.llm_engine.core.scheduler.spec_decoding_stats
    assert llm.llm_engine.num_preemptions > 0, "the small cache should have forced preemption"
    assert stats.num_accepted_tokens >= 50, stats
    pool = llm.llm_engine.core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    assert_greedy_equal(outs, reference, f"{spec['method']} {mode} x{llm.llm_engine.num_preemptions}, {stats}")
