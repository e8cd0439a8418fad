"""KV-cache sharing: prefix caching, parallel sampling over shared blocks with copy-on-write, swap
preemption. Sharing must never change a token. Prefix caching and the block accounting on the
real model; the engines that only compare one setting's tokens with another's on a tiny random
model (several engines each: seconds there, a minute on the real model)."""

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.kv_cache_manager import cdiv
from pagedllm.engine.output_processor import OutputKind

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def all_blocks_free(llm):
    pool = llm.llm_engine.core.scheduler.kv_cache_manager.block_pool
    return pool.get_num_free_blocks() == pool.num_blocks - 1 and all(b.ref_cnt == 0 for b in pool.blocks[1:])


@pytest.fixture(scope="module")
def shared_prefix_prompts(tokenizer):
    system = (
        "You are a careful assistant for a lighthouse museum. Answer briefly and kindly, "
        "cite the exhibit number when you can, and never invent opening hours. "
    ) * 3
    questions = [
        "When was the lamp installed?",
        "Who was the last keeper?",
        "Can I climb the stairs?",
        "Is there a gift shop?",
        "How tall is the tower?",
        "Are dogs allowed?",
    ]
    return [tokenizer(system + q)["input_ids"] for q in questions]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from pagedllm.models.random_model import make_random_model

    # A wider init than a real checkpoint's: peaked logits, so that the last-bit differences
    # between batch shapes never decide a token.
    return str(make_random_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", initializer_range=0.2))


@pytest.fixture(scope="module")
def tiny_shared_prefix_prompts():
    """Six prompts of 70-75 tokens: one 64-token prefix, then each its own question."""
    rng = np.random.default_rng(1)
    system = rng.integers(3, 512, 64).tolist()
    return [system + rng.integers(3, 512, 6 + i % 2).tolist() for i in range(6)]


def token_ids(outs):
    return [c.token_ids for o in outs for c in o.outputs]


def test_prefix_caching_on_off_equal(model_dir, shared_prefix_prompts):
    prompts = [{"prompt_token_ids": p} for p in shared_prefix_prompts]
    off = LLM(model_dir, max_model_len=512, enable_prefix_caching=False, block_size=8)
    ref = token_ids(off.generate(prompts, GREEDY, use_tqdm=False))
    del off
    on = LLM(model_dir, max_model_len=512, block_size=8)
    first = on.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(first) == ref
    assert all_blocks_free(on)
    # Second pass: every prompt's blocks are cached (all but the recomputed last token).
    again = on.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(again) == ref
    for o, p in zip(again, shared_prefix_prompts):
        assert o.num_cached_tokens == (len(p) - 1) // 8 * 8
    stats = on.llm_engine.core.scheduler.kv_cache_manager.stats
    assert stats.hit_rate > 0.5
    assert all_blocks_free(on)


def test_parallel_samples_at_temperature_zero_equal_single(tiny_dir, tiny_shared_prefix_prompts):
    for caching in (True, False):
        llm = LLM(tiny_dir, max_model_len=512, enable_prefix_caching=caching)
        prompts = [{"prompt_token_ids": p} for p in tiny_shared_prefix_prompts[:3]]
        single = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
        four = llm.generate(prompts, SamplingParams(n=4, temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        for out, ref in zip(four, single):
            assert len(out.outputs) == 4
            assert all(c.token_ids == ref for c in out.outputs)
        assert all_blocks_free(llm)


def test_best_of_keeps_the_highest_cumulative_logprob(model_dir, hf_model):
    """best_of=5, n=2: the two of the five samples (those n=5 draws with the same seed) whose
    cumulative logprob under transformers' logits is highest, best first."""
    import torch

    llm = LLM(model_dir, max_model_len=256)
    prompt = "A short poem about rain:"
    kw = dict(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    out = llm.generate(prompt, SamplingParams(n=2, best_of=5, **kw), use_tqdm=False)[0]
    assert len(out.outputs) == 2 and out.outputs[0].logprobs is None
    every = llm.generate(prompt, SamplingParams(n=5, **kw), use_tqdm=False)[0]
    p = every.prompt_token_ids
    scores = []
    with torch.inference_mode():
        for c in every.outputs:  # log_softmax of the raw logits at each sampled token, summed
            logits = hf_model(torch.tensor([p + list(c.token_ids)])).logits[0, len(p) - 1 : -1].float()
            lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None])
            scores.append(float(lp.sum()))
    order = sorted(range(5), key=lambda i: scores[i], reverse=True)
    assert scores[order[1]] - scores[order[2]] > 1e-3, scores  # no near-tie at the cut
    assert [c.token_ids for c in out.outputs] == [every.outputs[i].token_ids for i in order[:2]]


def _step_until(engine, cond, limit=200):
    for _ in range(limit):
        engine.step()
        if cond():
            return
    raise AssertionError("condition not reached")


def test_n8_samples_hold_the_prompt_once(model_dir):
    """n=8 samples of a 512-token prompt: the prompt's blocks once, plus each sibling's tail."""
    llm = LLM(model_dir, max_model_len=1024, enable_prefix_caching=False)
    engine = llm.llm_engine
    kv = engine.core.scheduler.kv_cache_manager
    prompt = [(i * 37) % 5000 + 100 for i in range(512)]
    engine.add_request(
        "p",
        {"prompt_token_ids": prompt},
        SamplingParams(n=8, temperature=1.0, seed=0, max_tokens=8, ignore_eos=True),
        kind=OutputKind.FINAL_ONLY,
    )
    sched = engine.core.scheduler
    _step_until(engine, lambda: len(sched.running) == 8 and all(r.num_output_tokens >= 4 for r in sched.running))
    bs = 16
    used = kv.block_pool.num_blocks - 1 - kv.num_free_blocks()
    shared_full = (512 - 1) // bs  # full blocks of the shared prompt
    tail = cdiv(512 + 8, bs) - shared_full  # each sibling's own blocks at most
    assert used <= shared_full + 8 * tail, used
    assert used < 8 * cdiv(512, bs) / 4  # far from eight private copies
    for b in kv.req_to_blocks[sched.running[0].request_id][:shared_full]:
        assert b.ref_cnt == 8
    while engine.has_unfinished_requests():
        engine.step()
    assert all_blocks_free(llm)


def test_shared_system_prompt_held_once(model_dir, tokenizer):
    llm = LLM(model_dir, max_model_len=1536)
    engine = llm.llm_engine
    kv = engine.core.scheduler.kv_cache_manager
    system = [(i * 53) % 7000 + 200 for i in range(1000)]
    for i in range(16):
        engine.add_request(
            f"r{i}",
            {"prompt_token_ids": system + [300 + i] * (5 + i)},
            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
            kind=OutputKind.FINAL_ONLY,
        )
    sched = engine.core.scheduler
    _step_until(engine, lambda: not sched.waiting and all(r.num_output_tokens >= 1 for r in sched.running))
    used = kv.block_pool.num_blocks - 1 - kv.num_free_blocks()
    # 62 full blocks of the system prompt once, then each request's own 1-3 blocks.
    assert used <= 1000 // 16 + 16 * 3, used
    while engine.has_unfinished_requests():
        engine.step()
    assert all_blocks_free(llm)


def test_swap_and_recompute_preemption_equal(tiny_dir, tiny_shared_prefix_prompts):
    prompts = [{"prompt_token_ids": p[-40 - 5 * i :]} for i, p in enumerate(tiny_shared_prefix_prompts)] * 2
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref_llm = LLM(tiny_dir, max_model_len=256, enable_prefix_caching=False)
    ref = token_ids(ref_llm.generate(prompts, params, use_tqdm=False))
    del ref_llm
    results = {}
    for mode in ("recompute", "swap"):
        llm = LLM(
            tiny_dir,
            max_model_len=256,
            num_gpu_blocks=24,
            preemption_mode=mode,
            num_cpu_blocks=64,
            enable_prefix_caching=False,
        )
        results[mode] = token_ids(llm.generate(prompts, params, use_tqdm=False))
        sched = llm.llm_engine.core.scheduler
        assert sched.num_preemptions > 0
        if mode == "swap":
            assert sched.num_swaps > 0
            assert len(sched.kv_cache_manager.free_cpu_blocks) == 63
        assert all_blocks_free(llm)
    assert results["recompute"] == ref
    assert results["swap"] == ref


def test_swap_space_full_falls_back_to_recompute(tiny_dir, tiny_shared_prefix_prompts):
    prompts = [{"prompt_token_ids": p[-60:]} for p in tiny_shared_prefix_prompts]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    # One usable CPU block: no preempted request (>= 4 blocks) fits, every one recomputes.
    llm = LLM(
        tiny_dir,
        max_model_len=256,
        num_gpu_blocks=16,
        preemption_mode="swap",
        num_cpu_blocks=2,
        enable_prefix_caching=False,
    )
    outs = token_ids(llm.generate(prompts, params, use_tqdm=False))
    sched = llm.llm_engine.core.scheduler
    assert sched.num_preemptions > 0 and sched.num_swaps == 0
    ref = LLM(tiny_dir, max_model_len=256, enable_prefix_caching=False)
    assert outs == token_ids(ref.generate(prompts, params, use_tqdm=False))
    assert all_blocks_free(llm)


def test_reset_prefix_cache(tiny_dir, tiny_shared_prefix_prompts):
    """LLM.reset_prefix_cache (vLLM's name) empties the cache between calls: the next pass
    computes every prompt in full, with the same tokens; refused while a request holds blocks."""
    prompts = [{"prompt_token_ids": p} for p in tiny_shared_prefix_prompts[:2]]
    llm = LLM(tiny_dir, max_model_len=256, block_size=8)
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    hit = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in hit] == [(len(p) - 1) // 8 * 8 for p in tiny_shared_prefix_prompts[:2]]
    assert llm.reset_prefix_cache() is True
    assert not llm.llm_engine.core.scheduler.kv_cache_manager.block_pool.cached_blocks
    cold = llm.generate(prompts, GREEDY, use_tqdm=False)
    # As on a fresh engine: the first prompt computed in full, the second hitting its prefix.
    assert [o.num_cached_tokens for o in cold] == [o.num_cached_tokens for o in first] == [0, 64]
    assert token_ids(cold) == token_ids(first) == token_ids(hit)
    # A request in flight: its blocks' hashes stay (the engine's later blocks chain from them).
    llm.llm_engine.add_request("busy", prompts[0], GREEDY)
    llm.llm_engine.step()
    assert llm.reset_prefix_cache() is False
    assert llm.llm_engine.core.scheduler.kv_cache_manager.block_pool.cached_blocks
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    assert llm.reset_prefix_cache() is True
    assert all_blocks_free(llm)
