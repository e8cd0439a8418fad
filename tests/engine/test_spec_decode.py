"""Speculative decoding in the one scheduler loop.

- Default model: greedy with n-gram drafts equals transformers' greedy token for token (ties as
  in the correctness rules) on a text that repeats itself, with 4-token blocks, chunked prefill
  (a small token budget) and preemption (a small KV cache) forced, in both preemption modes;
  drafts were accepted (the test is not vacuous) and no block is left in use; with the fixed
  and the adaptive length policy. The
  greedy-equality prompts with each proposer: tests/engine/test_greedy_equality.py.
- random:tiny: stop strings, max_tokens and n > 1 give what the engine without
  speculation gives; a run of sampled requests (drafts mostly rejected) leaves no block in use.
- Logprobs and prompt logprobs with drafts verified (one entry per emitted token, from the raw
  logits at its position), also for a request without drafts in a step where others verify
  theirs: the same tokens, ids and values (to float tolerance) as without speculation.
- The C++ decode loop takes verification steps (the cpu backend's metadata makes each draft a
  decode query) and computes there what the eager layers compute, bit for bit.
"""

import pytest
from greedy_utils import assert_greedy_equal, hf_greedy

from pagedllm import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MAX_TOKENS = 32
TEXT = (
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
    "The keeper fed his cat and watched the tide turn. The keeper fed his cat and watched the "
    "tide turn again, as he had every evening for thirty years.\n"
)


def assert_no_block_in_use(llm) -> None:
    sched = llm.llm_engine.core.scheduler
    pool = sched.kv_cache_manager.block_pool
    assert not sched.running and not sched.waiting
    assert pool.get_num_free_blocks() == pool.num_blocks - 1, "a KV block leaked"


@pytest.fixture(scope="module")
def prompts(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    return [ids, ids[20:], tokenizer("Write the same sentence twice: the cat sat on the mat.")["input_ids"]]


@pytest.fixture(scope="module")
def reference(hf_model, prompts):
    return hf_greedy(hf_model, prompts, MAX_TOKENS)


@pytest.mark.parametrize("mode, policy", [("recompute", "fixed"), ("swap", "fixed"), ("recompute", "adaptive")])
def test_greedy_equals_transformers(model_dir, prompts, reference, mode, policy):
    """Tiny blocks (drafts cross block boundaries) and a 24-token budget; the greedy-equality
    prompts' spec tests (tests/engine/test_greedy_equality.py) run with the default blocks. The
    adaptive length policy (which drafts by the step times it measures) too."""
    llm = LLM(
        model_dir,
        speculative_config={**NGRAM, "length_policy": policy},
        num_gpu_blocks=40,
        block_size=4,
        max_num_batched_tokens=24,
        preemption_mode=mode,
        num_cpu_blocks=64,
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
        use_tqdm=False,
    )
    stats = llm.llm_engine.core.scheduler.spec_decoding_stats
    assert llm.llm_engine.num_preemptions > 0, "the small cache should have forced preemption"
    # The fixed policy drafts every step, so this text must have accepted many; the adaptive one
    # drafts by the step times this machine measures (fewer on a loaded one), so only some.
    assert stats.num_accepted_tokens >= (10 if policy == "fixed" else 1), stats
    assert_greedy_equal(outs, reference, f"ngram {policy}, {mode} x{llm.llm_engine.num_preemptions}, {stats}")
    assert_no_block_in_use(llm)


@pytest.fixture(scope="module")
def tiny_pair():
    plain = LLM("random:tiny", max_model_len=128, block_size=4, num_gpu_blocks=64)
    spec = LLM("random:tiny", max_model_len=128, block_size=4, num_gpu_blocks=64, speculative_config=NGRAM)
    return plain, spec


TINY_PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 12, 13, 9, 10], [40] * 6]


def assert_logprobs_close(got, want) -> None:
    """Lists of {token id: Logprob} (or None): the same ids and ranks, values within float error
    (a verification scores a token in a forward of several rows, a plain step in one of one)."""
    assert (got is None) == (want is None)
    assert len(got or []) == len(want or [])
    for g, w in zip(got or [], want or []):
        if g is None or w is None:  # prompt logprobs: the first prompt token has none
            assert g is w
            continue
        assert list(g) == list(w)
        for t in w:
            assert g[t].rank == w[t].rank
            assert abs(g[t].logprob - w[t].logprob) < 1e-4, (t, g[t], w[t])


def test_stop_max_tokens_n_as_without_speculation(tiny_pair):
    plain, spec = tiny_pair
    cases = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, n=2, ignore_eos=True),
    ]
    prompts = [{"prompt_token_ids": p} for p in TINY_PROMPTS]
    for params in cases:
        want = plain.generate(prompts, params, use_tqdm=False)
        got = spec.generate(prompts, params, use_tqdm=False)
        for w, g in zip(want, got):
            assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs], params
            assert [c.text for c in g.outputs] == [c.text for c in w.outputs]
    # A stop string cut from the text of a greedy run: the same text ends there with speculation.
    text = plain.generate(prompts[:1], cases[0], use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(temperature=0.0, max_tokens=30, stop=[stop], ignore_eos=True)
    w, g = (llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0] for llm in (plain, spec))
    assert (g.text, g.token_ids, g.finish_reason) == (w.text, w.token_ids, w.finish_reason)
    assert w.finish_reason == "stop"
    assert spec.llm_engine.core.scheduler.spec_decoding_stats.num_accepted_tokens > 0
    assert_no_block_in_use(spec)


def test_logprobs_with_drafts_as_without_speculation(tiny_pair):
    plain, spec = tiny_pair
    stats = spec.llm_engine.core.scheduler.spec_decoding_stats
    prompts = [{"prompt_token_ids": p} for p in TINY_PROMPTS]
    mixed = [
        SamplingParams(temperature=0.0, max_tokens=20, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),  # drafts beside the others
        SamplingParams(temperature=0.0, max_tokens=13, logprobs=0, prompt_logprobs=1, ignore_eos=True),
    ]
    for params in ([mixed[0]] * 3, mixed):
        accepted = stats.num_accepted_tokens
        want = plain.generate(prompts, params, use_tqdm=False)
        got = spec.generate(prompts, params, use_tqdm=False)
        assert stats.num_accepted_tokens > accepted + 4  # some logprobs came from accepted drafts
        for w, g, p in zip(want, got, params):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            assert len(g.outputs[0].logprobs or []) == (len(g.outputs[0].token_ids) if p.logprobs is not None else 0)
            assert_logprobs_close(g.outputs[0].logprobs, w.outputs[0].logprobs)
            assert_logprobs_close(g.prompt_logprobs, w.prompt_logprobs)
            if p.logprobs is not None:
                assert g.outputs[0].cumulative_logprob == pytest.approx(w.outputs[0].cumulative_logprob, abs=1e-3)
    assert_no_block_in_use(spec)


def test_mostly_rejected_drafts_leak_no_block(tiny_pair):
    _, spec = tiny_pair
    stats = spec.llm_engine.core.scheduler.spec_decoding_stats
    before = (stats.num_draft_tokens, stats.num_accepted_tokens)
    params = SamplingParams(temperature=1.5, max_tokens=40, ignore_eos=True, seed=1)
    # Prompts of 80 distinct ids: a sampled id often occurred before (a 1-gram hit: one draft),
    # and the near-uniform sample after it rarely follows the prompt.
    prompts = [list(range(s, s + 80)) for s in (3, 83, 163)] * 3
    spec.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    drafted, accepted = stats.num_draft_tokens - before[0], stats.num_accepted_tokens - before[1]
    assert drafted > 20 and accepted < drafted / 2, (drafted, accepted)
    assert_no_block_in_use(spec)


def test_decode_loop_takes_steps_with_drafts():
    """A row verifying 4 drafts has query length 5: the cpu backend's metadata makes its tokens 5
    decode queries over their own prefixes (all-decode, lengths 6..10), so `DecodeLoop.applies`
    takes the step, as it does two such rows (10 tokens: the packed linears' rows); the reference
    backend's (max_decode_query_len 1) keeps it a prefill chunk."""
    import numpy as np
    import torch
    from pagedllm.attention.backends.cpu_attn import CPUAttentionBackend
    from pagedllm.attention.backends.torch_sdpa.metadata import build_attention_metadata
    from pagedllm.models.cpu_decode_loop import DecodeLoop
    from types import SimpleNamespace

    loop = DecodeLoop.__new__(DecodeLoop)  # applies() reads the metadata, LoRA, the cache's arity, large_rows
    loop.lora_mapping, loop.attns = None, [SimpleNamespace(kv_cache=(torch.empty(0), torch.empty(0)))]
    loop.large_rows = None  # no bound (the linears' eager_from_rows where they leave the loop's kernels)
    table = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int32)
    q = CPUAttentionBackend.max_decode_query_len

    def meta(starts, lens, **kw):
        starts = np.array(starts, dtype=np.int32)
        return build_attention_metadata(
            starts,
            np.array(lens, dtype=np.int32),
            table[: len(lens)],
            4,
            torch.arange(int(starts[-1])),
            decode_by_pages=True,
            **kw,
        )

    spec = meta([0, 5], [10], max_decode_query_len=q)
    assert spec.all_decode and spec.decode_token_idx.tolist() == [0, 1, 2, 3, 4]
    assert spec.decode_seq_lens.tolist() == [6, 7, 8, 9, 10] and loop.applies(spec, 5)
    assert not loop.applies(meta([0, 5], [10]), 5)  # a prefill chunk
    assert loop.applies(meta([0, 5, 10], [10, 12], max_decode_query_len=q), 10)  # 10 rows
    assert not meta([0, 5], [5], max_decode_query_len=q).all_decode  # no past: a prompt


def test_decode_loop_verifies_drafts_as_the_eager_layers(tiny_pair, monkeypatch):
    """random:tiny with n-gram drafts, with the loop: every loop call of the run is checked
    against the eager layers on the same inputs (same hidden states, bit for bit; the eager
    path rewrites the same K/V), and verification steps (one request, 2-5 rows) were among
    them; the greedy tokens are those of the engine without speculation. Every n-gram hit drafts
    the full k here (the proposer drafts 2 (n - 1) tokens, and this model's output rarely
    repeats 3-grams), so that 5-row verifications occur."""
    import torch
    from kernel_utils import require_decode_loop
    from pagedllm.spec_decode import ngram_proposer

    monkeypatch.setattr(ngram_proposer, "draft_length", lambda n, k: k)
    plain, spec = tiny_pair
    runner = spec.llm_engine.core.model_executor.driver_worker.model_runner
    loop, verified = require_decode_loop(runner), []

    class Checked:
        applies = loop.applies

        def __call__(self, input_ids, positions):
            out = loop(input_ids, positions)
            assert torch.equal(out, runner.model(input_ids, positions)), positions
            if len(positions) > 1 and bool((positions.diff() == 1).all()):  # one request's k + 1 tokens
                verified.append(len(positions))
            return out

    runner.decode_loop = Checked()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in TINY_PROMPTS[:1]]
        got = spec.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        runner.decode_loop = loop
    assert verified and max(verified) == 1 + NGRAM["num_speculative_tokens"], verified
    assert got == plain.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids


def test_self_draft_proposes_what_the_truncated_model_generates():
    """'self:1' on random:tiny (2 layers): the drafts after the first step are transformers'
    greedy continuation of the same model cut to its first layer (its LM head, its final norm)."""
    import torch
    from transformers import AutoModelForCausalLM
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.models.random_model import random_model_dir

    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model="random:tiny",
            max_model_len=128,
            block_size=4,
            num_gpu_blocks=64,
            speculative_config={"method": "draft_model", "model": "self:1", "num_speculative_tokens": 4},
        )
    )
    prompt = [7, 100, 33, 250, 9, 71]
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=20))
    engine.step()
    request = engine.core.scheduler.requests["r"]
    first, drafts = request.output_token_ids, request.spec_token_ids
    hf = AutoModelForCausalLM.from_pretrained(random_model_dir("random:tiny"))
    hf.model.layers = hf.model.layers[:1]
    hf.config.num_hidden_layers = 1
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([prompt + first]), do_sample=False, max_new_tokens=4)[0, len(prompt) + 1 :]
    assert len(first) == 1 and drafts == ref.tolist()
    engine.shutdown()
