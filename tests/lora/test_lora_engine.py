"""Adapters served by the engine on a tiny random-weight Llama: greedy output of each request
equals transformers' model with its adapter merged by PEFT (merge_and_unload), token for token,
in mixed batches (adapters and base interleaved, chunked prefill, preemption), with more
adapters than slots, and the prefix cache kept apart per adapter."""

import pytest
from greedy_utils import assert_greedy_equal, hf_greedy
from kernel_utils import decode_loop_off_reason, require_decode_loop

from pagedllm import SamplingParams
from pagedllm.entrypoints.llm import LLM

PROMPTS = [
    [5 + i, 17, 3 * i + 40, 9, 200 + i, 33, 71, 8 + 2 * i, 120, 64 + i, 11, 300 - i][: 6 + i % 7] for i in range(12)
]


def _runner(llm):
    return llm.llm_engine.core.model_executor.driver_worker.model_runner


class _LoopSpy:
    """The runner's C++ decode loop, recording whether an adapter was active at each call."""

    def __init__(self, runner):
        self.loop, self.mapping, self.active_at_call = runner.decode_loop, runner.lora_manager.mapping, []
        self.applies = self.loop.applies

    def __call__(self, input_ids, positions):
        self.active_at_call.append(self.mapping.active)
        return self.loop(input_ids, positions)


def _check(llm, prompts, loras, refs, max_tokens, label):
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False, lora_request=loras
    )
    for i, (p, lora, out) in enumerate(zip(prompts, loras, outs)):
        ref = hf_greedy(refs[lora.lora_int_id if lora else 0], [p], max_tokens)
        assert_greedy_equal([out], ref, f"{label} #{i} {lora.lora_name if lora else 'base'}")
    return outs


def test_mixed_batch_chunked_prefill_preemption(tiny_dir, tiny_adapters, tiny_references):
    """Three adapters and the base interleaved; the base requests decode longest, alone, so the
    C++ decode loop runs its base-only steps (and never a step with an adapter)."""
    llm = LLM(
        tiny_dir,
        enable_lora=True,
        max_loras=3,
        max_lora_rank=16,
        block_size=4,
        max_num_batched_tokens=16,
        num_gpu_blocks=24,
        max_model_len=128,
    )
    runner = _runner(llm)
    spy = None
    if decode_loop_off_reason() is None:  # else the greedy checks still run, without the loop
        require_decode_loop(runner)
        runner.decode_loop = spy = _LoopSpy(runner)
    loras = [tiny_adapters[i % 4 - 1] if i % 4 else None for i in range(8)]  # base, a1, a2, a3, base, ...
    outs = llm.generate(PROMPTS[:8], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False, lora_request=loras)
    base_outs = llm.generate(PROMPTS[:8], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    changed = sum(o.outputs[0].token_ids != b.outputs[0].token_ids for o, b, l in zip(outs, base_outs, loras) if l)
    assert changed >= 5, "the adapters should change the greedy output"
    for i, (p, lora, out) in enumerate(zip(PROMPTS, loras, outs)):
        assert_greedy_equal(
            [out],
            hf_greedy(tiny_references[lora.lora_int_id if lora else 0], [p], 10),
            f"mixed #{i} {lora.lora_name if lora else 'base'}",
        )
    assert llm.llm_engine.num_preemptions > 0, "the small cache should have forced preemption"
    # Base alone decoding long after the adapters finished: the loop's steps.
    _check(llm, PROMPTS[:3], [tiny_adapters[0], None, None], tiny_references, 10, "tail")
    if spy is not None:
        assert spy.active_at_call and not any(spy.active_at_call), "the decode loop ran a step with an adapter"
        assert False in spy.active_at_call


def test_more_adapters_than_slots(tiny_dir, tiny_adapters, tiny_references, monkeypatch):
    """Six adapters, two slots, three kept in host memory: every request finishes correctly
    (through the per-slot segments: the masked dense path is turned off here; the other tests
    run it)."""
    from pagedllm.lora import punica

    monkeypatch.setattr(punica, "DENSE_MAX_TOKENS", 0)
    llm = LLM(tiny_dir, enable_lora=True, max_loras=2, max_cpu_loras=3, max_lora_rank=16, max_model_len=128)
    loras = [tiny_adapters[i % 6] for i in range(12)]
    _check(llm, PROMPTS, loras, tiny_references, 6, "6 adapters / 2 slots")
    manager = _runner(llm).lora_manager
    assert len(manager.slots) == 2 and len(manager.host) == 3


def test_prefix_cache_is_per_adapter(tiny_dir, tiny_adapters):
    llm = LLM(tiny_dir, enable_lora=True, max_loras=2, block_size=4, max_model_len=128)
    prompt = list(range(10, 30))
    params = SamplingParams(temperature=0, max_tokens=1)
    a1, a2 = tiny_adapters[0], tiny_adapters[1]
    first = llm.generate([prompt], params, use_tqdm=False, lora_request=a1)[0]
    assert first.num_cached_tokens == 0
    assert llm.generate([prompt], params, use_tqdm=False, lora_request=a1)[0].num_cached_tokens == 16
    assert llm.generate([prompt], params, use_tqdm=False, lora_request=a2)[0].num_cached_tokens == 0
    assert llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens == 0


def test_bad_lora_requests_are_refused(tiny_dir, tiny_adapters, tmp_path):
    from pagedllm.lora import LoRARequest

    llm = LLM(tiny_dir, max_model_len=64)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate([[5, 6]], lora_request=tiny_adapters[0], use_tqdm=False)
    llm = LLM(tiny_dir, enable_lora=True, max_lora_rank=8, max_model_len=64)
    with pytest.raises(ValueError, match="max_lora_rank"):
        llm.generate([[5, 6]], lora_request=tiny_adapters[2], use_tqdm=False)  # r 16
    with pytest.raises(ValueError, match="not a directory"):
        llm.generate([[5, 6]], lora_request=LoRARequest("x", 9, str(tmp_path / "none")), use_tqdm=False)
    llm.generate([[5, 6]], lora_request=tiny_adapters[0], use_tqdm=False)
    with pytest.raises(ValueError, match="already adapter"):
        llm.generate([[5, 6]], lora_request=LoRARequest("y", 1, tiny_adapters[1].lora_path), use_tqdm=False)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(tiny_dir, enable_lora=True, tensor_parallel_size=2)
