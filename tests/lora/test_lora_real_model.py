"""The default real model with three peft-made adapters and the base interleaved in one batch,
chunked prefill and preemption forced: greedy output equals each adapter's merge_and_unload()
model in transformers, token for token (ties as in docs/design.md)."""

from greedy_utils import assert_greedy_equal, hf_greedy, hf_greedy_batched
from lora_utils import make_adapter

from pagedllm import SamplingParams
from pagedllm.entrypoints.llm import LLM
from pagedllm.lora import LoRARequest

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]


def test_mixed_adapters_equal_merged_models(model_dir, tokenizer, hf_model, tmp_path):
    adapters, refs = [None], [hf_model]
    for i in (1, 2, 3):  # ranks 8, 16, 24; rsLoRA on the second
        path, merged = make_adapter(
            model_dir, str(tmp_path / f"a{i}"), seed=i, r=8 * i, scale=0.03, use_rslora=i == 2, merged=True
        )
        adapters.append(LoRARequest(f"a{i}", i, path))
        refs.append(merged)
    prompts = [tokenizer(t).input_ids for t in TEXTS]
    llm = LLM(
        model_dir,
        enable_lora=True,
        max_loras=3,
        max_lora_rank=24,
        max_num_batched_tokens=12,
        block_size=4,
        num_gpu_blocks=14,
    )
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False, lora_request=adapters)
    assert llm.llm_engine.num_preemptions > 0, "the small cache should have forced preemption"
    base = hf_greedy_batched(hf_model, prompts, 10)  # what the adapters change (one generate)
    changed = 0
    for i, (p, lora, out) in enumerate(zip(prompts, adapters, outs)):
        ref = hf_greedy(refs[i], [p], 10)
        assert_greedy_equal([out], ref, f"#{i} {lora.lora_name if lora else 'base'}")
        if lora is not None:
            changed += out.outputs[0].token_ids != base[i][0]
    assert changed >= 2, "the adapters should change the greedy output"
