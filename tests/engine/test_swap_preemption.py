"""Swap preemption on a real (tiny, random-weight) model: a KV cache far too small for the
workload swaps requests out to the CPU block pool and back in the middle of chunked prefills
(the request swapped out is halfway through its prompt, and another one is too). Greedy and
seeded sampled requests (and a seeded n=2 one) must give exactly what the same requests give
with a cache big enough that nothing is preempted."""

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams

PROMPT_LENGTHS = [5, 70, 23, 90, 12, 45, 33, 60]
MAX_TOKENS = 24
# 4-token blocks and a 16-token budget: a 90-token prompt is prefilled over 6 steps, while the
# running requests' decodes take their share of the budget.
SETTINGS = dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=6, max_model_len=256)
# 39 usable blocks (156 slots) hold the longest request (90 + 24 tokens) but not a third of the
# ~530 tokens of work; 128 CPU blocks take every swap (none falls back to recompute).
SMALL_CACHE = dict(num_gpu_blocks=40, preemption_mode="swap", num_cpu_blocks=128)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from pagedllm.models.random_model import make_random_model

    # A wider init than a real checkpoint's: peaked logits, so that the last-bit differences
    # between batch shapes (the kernels differ by row count) never decide a token.
    return str(make_random_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", initializer_range=0.2))


def _workload():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 512, n).tolist() for n in PROMPT_LENGTHS]
    params = []
    for i in range(len(prompts)):
        if i % 2 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        else:
            params.append(
                SamplingParams(
                    temperature=1.0,
                    top_p=0.9,
                    seed=100 + i,
                    max_tokens=MAX_TOKENS,
                    ignore_eos=True,
                    n=2 if i == 3 else 1,
                )
            )
    return prompts, params


def _run(llm, prompts, params, on_step=lambda: None):
    """Step the engine to the end -> {request id: [token ids of each sample]}."""
    engine = llm.llm_engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp)
    done = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [list(c.token_ids) for c in out.outputs]
        on_step()
    assert not engine.has_unfinished_requests(), "the workload did not finish in 10,000 steps"
    return done


def _mid_prefill(r):
    return 0 < r.num_computed_tokens < r.num_prompt_tokens


def test_swap_during_chunked_prefill_equals_no_preemption(tiny_dir):
    prompts, params = _workload()
    ref_llm = LLM(tiny_dir, **SETTINGS)
    reference = _run(ref_llm, prompts, params)
    assert ref_llm.llm_engine.num_preemptions == 0, "the reference must not preempt"

    llm = LLM(tiny_dir, **SETTINGS, **SMALL_CACHE)
    sched = llm.llm_engine.core.scheduler
    kv = sched.kv_cache_manager
    seen = {"swaps of a request mid-prefill": 0, "swaps while another request is mid-prefill": 0}
    swapped_before = set()

    def on_step():
        # After a step, a request whose prompt is only partly computed is in a chunked prefill
        # (running, or swapped out in the middle of it).
        swapped = {r.request_id for r in sched.waiting if kv.is_swapped(r)}
        new = swapped - swapped_before
        if new:
            mid = {rid for rid, r in sched.requests.items() if _mid_prefill(r)}
            seen["swaps of a request mid-prefill"] += bool(mid & new)
            seen["swaps while another request is mid-prefill"] += bool(mid - new)
        swapped_before.clear()
        swapped_before.update(swapped)

    got = _run(llm, prompts, params, on_step)
    print(f"preemptions {sched.num_preemptions}, swaps {sched.num_swaps}, {seen}")
    assert sched.num_swaps > 0 and sched.num_swaps == sched.num_preemptions, "every preemption swaps"
    assert all(seen.values()), seen
    assert len(got) == len(prompts) and all(len(c) == MAX_TOKENS for s in got.values() for c in s)
    assert got == reference
    pool = kv.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    assert len(kv.free_cpu_blocks) == SMALL_CACHE["num_cpu_blocks"] - 1
