"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers: every prompt token's
reported logprob, rank and top k equal log_softmax of transformers' logits at the position
before it, within 1e-4 (ties as in test_logprobs.py), whatever the chunking of the prefill, a
prefix-cache hit, parallel sampling or preemption. vLLM's shape: None for the first token, then
one dict per token with the prompt token first."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from engine.test_logprobs import _prompt, check_logprob_dicts, tiny_dir, tiny_hf  # noqa: F401 (fixtures)
from server_utils import TINY


def hf_prompt_logprobs(hf_model, prompt_ids: list[int]) -> torch.Tensor:
    """[P - 1, V]: row i predicts prompt token i + 1."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt_ids])).logits[0, :-1]
    return torch.log_softmax(logits.double(), dim=-1)


def check_prompt_logprobs(hf_model, prompt_ids: list[int], plps, k: int, where: str = "") -> None:
    assert plps is not None and len(plps) == len(prompt_ids) and plps[0] is None, where
    check_logprob_dicts(hf_prompt_logprobs(hf_model, prompt_ids), prompt_ids[1:], plps[1:], k, where)


@pytest.fixture(scope="module")
def llm():
    # A budget of 16 tokens: prompts of up to 90 tokens are prefilled in up to 6 chunks, beside
    # each other's chunks and decodes.
    return LLM(TINY, max_model_len=256, max_num_batched_tokens=16, max_num_seqs=8, block_size=4)


def test_chunked_prefill_equals_transformers(llm, tiny_hf):
    """Rows that ask (k = 0, 3, 20), with a plain row between them, in one chunked batch."""
    prompts = [_prompt(10 + i, n) for i, n in enumerate((37, 2, 90, 21))]
    ks = [3, None, 20, 0]
    params = [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=k) for k in ks]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, k, out in zip(prompts, ks, outs):
        if k is None:
            assert out.prompt_logprobs is None
        else:
            check_prompt_logprobs(tiny_hf, p, out.prompt_logprobs, k, f"k={k}")
    # One token: nothing to score.
    one = llm.generate([{"prompt_token_ids": [7]}], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    assert one[0].prompt_logprobs == [None]


def test_prefix_cache_hit_is_recomputed(llm, tiny_hf):
    """A cached prefix is recomputed for a request that asks (no gap, the values of a full
    prefill); the cache still serves the requests that do not ask."""
    prefix = _prompt(40, 48)
    first = llm.generate([{"prompt_token_ids": prefix + [5, 6]}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    p = prefix + [9, 10, 11]
    out = llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=2, prompt_logprobs=4), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and out.num_cached_tokens == 0
    check_prompt_logprobs(tiny_hf, p, out.prompt_logprobs, 4, "after a cached prefix")
    plain = llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert plain.num_cached_tokens >= 48


def test_parallel_sampling_reports_them_once(llm, tiny_hf):
    """n = 3: the parent computes the prompt; its logprobs come once, on the request."""
    p = _prompt(50, 30)
    out = llm.generate(
        [{"prompt_token_ids": p}], SamplingParams(n=3, seed=0, max_tokens=4, prompt_logprobs=1), use_tqdm=False
    )[0]
    assert len(out.outputs) == 3
    check_prompt_logprobs(tiny_hf, p, out.prompt_logprobs, 1, "n=3")


def test_preempted_prefill_reports_each_token_once(tiny_hf):
    """A KV cache too small for both: the newer request is preempted, recomputes its prompt and
    still reports each prompt token once, with a full prefill's values."""
    llm = LLM(
        TINY,
        max_model_len=128,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        block_size=4,
        num_gpu_blocks=24,
        enable_prefix_caching=False,
    )
    prompts = [_prompt(60, 40), _prompt(61, 40)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    for i, (p, out) in enumerate(zip(prompts, outs)):
        check_prompt_logprobs(tiny_hf, p, out.prompt_logprobs, 2, f"request {i}")


def test_split_model_refuses_them(llm):
    """A model split by tensor / pipeline parallelism does not compute them: a ValueError naming
    the field, before anything runs (the Processor of such an engine, on the same tokenizer)."""
    import copy
    import dataclasses

    from pagedllm.config import ParallelConfig
    from pagedllm.sampling_params import ParamError

    proc = copy.copy(llm.llm_engine.processor)
    proc.config = dataclasses.replace(proc.config, parallel_config=ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(ParamError, match="prompt_logprobs") as e:
        proc.process("r", [5, 6, 7], SamplingParams(prompt_logprobs=1))
    assert e.value.param == "prompt_logprobs"
    proc.process("r", [5, 6, 7], SamplingParams())  # the rest is unchanged
