"""Async scheduling (core/async_scheduler.py, worker/async_output.py) on the CPU, random:tiny.

- Greedy equals transformers token for token with chunked prefill (a 16-token budget) and
  preemption (a 30-block cache; recompute and swap) forced; each step scheduled before the
  output of the one before is applied (the runner took its input tokens from the previous
  step's sampled tensor); no block is left in use.
- On the CPU the steps run on the engine's thread (as vLLM's CPU path, which turns the flag
  off): no step thread, whose malloc arena and cores the engine's thread did not share.
- Stop strings, max_tokens, min_tokens, n > 1, seeded sampling with penalties and logprobs give
  exactly what the engine without async scheduling gives (same seeds, same random streams).
- The CUDA-graph static-buffer path (eager, Triton's interpreter) takes the token in flight too.
- Streaming through AsyncLLM (the core in its own process) gives the offline tokens.
- What it cannot serve is refused with a ValueError naming the field.
"""

import asyncio

import pytest
import torch
from greedy_utils import assert_greedy_equal, hf_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.models.random_model import random_model_dir

TINY = "random:tiny"
ENGINE = dict(max_model_len=128, block_size=4, num_gpu_blocks=30, max_num_batched_tokens=16)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 12, 13, 9, 10] * 5, [40] * 6, list(range(3, 60))]


@pytest.fixture(scope="module")
def engines():
    return LLM(TINY, async_scheduling=True, **ENGINE), LLM(TINY, **ENGINE)


def _assert_no_block_in_use(llm) -> None:
    sched = llm.llm_engine.core.scheduler
    pool = sched.kv_cache_manager.block_pool
    assert not sched.running and not sched.waiting
    assert pool.get_num_free_blocks() == pool.num_blocks - 1, "a KV block leaked"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_equals_transformers(engines, mode):
    from transformers import AutoModelForCausalLM

    llm = (
        engines[0]
        if mode == "recompute"
        else LLM(TINY, async_scheduling=True, preemption_mode="swap", num_cpu_blocks=64, **ENGINE)
    )
    hf = AutoModelForCausalLM.from_pretrained(str(random_model_dir(TINY)), dtype=torch.float32).eval()
    reference = hf_greedy(hf, PROMPTS, 40)
    outputs = llm.llm_engine.core.model_executor.driver_worker.model_runner.async_outputs
    fill, filled = outputs.fill_placeholders, []
    outputs.fill_placeholders = lambda ids, inputs: fill(ids, inputs) or filled.append(len(outputs.filled))
    before = llm.llm_engine.num_preemptions
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False
    )
    outputs.fill_placeholders = fill
    assert llm.llm_engine.num_preemptions > before, "the small cache should have forced preemption"
    assert sum(filled) > 20, "no step took its input token from the step in flight"
    assert_greedy_equal(outs, reference, "async scheduling")
    _assert_no_block_in_use(llm)


def test_cpu_steps_run_on_the_engines_thread(engines):
    import threading

    llm = engines[0]
    runner = llm.llm_engine.core.model_executor.driver_worker.model_runner
    step, threads = runner.execute_model, set()
    runner.execute_model = lambda so: threads.add(threading.get_ident()) or step(so)
    try:
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    finally:
        del runner.execute_model  # the instance attribute: the method again
    assert threads == {threading.get_ident()}
    assert not [t.name for t in threading.enumerate() if t.name.startswith("pagedllm-step")]


CASES = {
    "max_tokens": SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
    "stop string": SamplingParams(temperature=0, max_tokens=30, stop=["w7"], ignore_eos=True),
    "min_tokens": SamplingParams(temperature=0, max_tokens=20, min_tokens=12),
    "n=2 seeded, penalties, logprobs": SamplingParams(
        temperature=0.8, seed=3, max_tokens=24, n=2, repetition_penalty=1.3, presence_penalty=0.5, logprobs=2
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_same_outputs_as_without(engines, case):
    on, off = engines
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    got = on.generate(prompts, CASES[case], use_tqdm=False)
    want = off.generate(prompts, CASES[case], use_tqdm=False)
    for g, w in zip(got, want):
        assert [(c.token_ids, c.text, c.finish_reason) for c in g.outputs] == [
            (c.token_ids, c.text, c.finish_reason) for c in w.outputs
        ], case
        for gc, wc in zip(g.outputs, w.outputs):
            if wc.logprobs is not None:
                assert [sorted(d) for d in gc.logprobs] == [sorted(d) for d in wc.logprobs]
    _assert_no_block_in_use(on)


def test_streaming_through_async_llm(engines):
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [
        o.outputs[0].token_ids
        for o in engines[1].generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    ]

    async def run():
        engine = await AsyncLLM.create(EngineArgs(model=TINY, async_scheduling=True, **ENGINE))
        try:

            async def one(i, p):
                tokens = []
                async for out in engine.generate({"prompt_token_ids": p}, params, f"s{i}"):
                    tokens += out.outputs[0].token_ids  # DELTA: each chunk's new tokens
                return tokens

            return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
        finally:
            await engine.shutdown()

    assert asyncio.run(run()) == want


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative_config"),
        (dict(runner="pooling"), "pooling"),
        (dict(pipeline_parallel_size=2), "pipeline_parallel_size"),
    ],
)
def test_refused_engines(kwargs, field):
    with pytest.raises(ValueError, match=f"async_scheduling is not supported with .*{field}"):
        LLM(TINY, async_scheduling=True, **ENGINE, **kwargs)


def test_refused_requests(engines):
    from pagedllm.sampling_params import ParamError, StructuredOutputsParams

    llm = engines[0]
    with pytest.raises(ParamError, match="beam search") as e:
        llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], beam_width=2, max_tokens=4)
    assert e.value.param == "beam_width"
    with pytest.raises(ParamError) as e:
        llm.generate(
            [{"prompt_token_ids": PROMPTS[0]}],
            SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["a", "b"])),
            use_tqdm=False,
        )
    assert e.value.param == "structured_outputs"
    _assert_no_block_in_use(llm)


def test_failed_step_rolls_back(engines):
    """A step that raises (an injected fault on token 500) with another step in flight: both
    are dropped, the culprit is convicted, the others finish with the tokens they would have."""
    from pagedllm.engine.exceptions import RequestFailedError
    from pagedllm.worker.fault_injection import FaultInjector

    on, off = engines
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = PROMPTS[:3] + [[500, 7, 8]]
    want = [
        o.outputs[0].token_ids
        for o in off.generate([{"prompt_token_ids": p} for p in prompts[:3]], params, use_tqdm=False)
    ]
    engine = on.llm_engine
    runner = engine.core.model_executor.driver_worker.model_runner
    runner.faults = FaultInjector({500: "raise"})
    try:
        for i, p in enumerate(prompts):
            engine.add_request(f"f{i}", {"prompt_token_ids": p}, params)
        done, failed = {}, []
        while engine.has_unfinished_requests():
            try:
                done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
            except RequestFailedError as e:
                failed += e.req_ids
    finally:
        runner.faults = None
    assert failed == ["f3"]
    assert [done[f"f{i}"] for i in range(3)] == want
    _assert_no_block_in_use(on)


def test_decode_graph_path_takes_tokens_in_flight(engines):
    """The static-buffer path a CUDA graph replays (run eagerly under Triton's interpreter,
    capture=False): the token of the step in flight is copied into the graph's input buffer."""
    from pagedllm.worker.cuda_graph import StepGraphs

    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    llm = LLM(TINY, attention_backend="triton", async_scheduling=True, max_model_len=64, max_num_seqs=4)
    runner = llm.llm_engine.core.model_executor.driver_worker.model_runner
    runner.graphs = graphs = StepGraphs(runner, [1, 2, 4], capture=False)
    outputs = runner.async_outputs
    fill, filled = outputs.fill_placeholders, []
    outputs.fill_placeholders = lambda ids, inputs: fill(ids, inputs) or filled.append(ids.data_ptr())
    got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)
    want = engines[1].generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert graphs.input_ids.data_ptr() in filled, "no graph step took a token from the step in flight"
