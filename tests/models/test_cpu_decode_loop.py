"""The C++ decode loop (models/cpu_decode_loop.py) equals the eager layers bit for bit: the same
greedy tokens and the same logprobs, to the last bit, in float32 and bfloat16, at 1-3 requests
(and at 1-8 rows of verification steps, tests/engine/test_spec_decode.py);
a step of more requests, or with a prefill, takes the eager path."""

import pytest
from kernel_utils import require_built

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.model

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,"]


class _Counting:
    """The loop, recording the rows of each call."""

    def __init__(self, loop, calls):
        self.loop, self.calls, self.applies = loop, calls, loop.applies

    def __call__(self, input_ids, positions):
        self.calls.append(input_ids.shape[0])
        return self.loop(input_ids, positions)


def _decode_loop(llm):
    """The engine's runner, whose C++ decode loop is built wherever a compiler exists."""
    from pagedllm import envs
    from pagedllm.attention.backends.cpu_attn.kernels import decode_kernel
    from pagedllm.models.cpu_decode_loop import decode_loop_ext
    from pagedllm.models.layers.cpu_packed_linear import packed_linear_supported
    from pagedllm.models.cpu_ops import cpu_ops

    runner = llm.llm_engine.core.model_executor.driver_worker.model_runner
    model = runner.model
    if not envs.PAGEDLLM_CPU_DECODE_LOOP:  # as the engine reads it
        pytest.skip("the decode loop is turned off here (PAGEDLLM_CPU_DECODE_LOOP=0)")
    dtype = model.norm.weight.dtype
    if not packed_linear_supported(dtype):
        pytest.skip(f"no oneDNN {dtype} linear here (this torch build or CPU): the decode loop needs it")
    for ext in (cpu_ops, decode_kernel, decode_loop_ext):
        require_built(ext())
    assert runner.decode_loop is not None, "the extensions are built, yet the engine did not enable the loop"
    return runner


def _run(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=3, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [
        (o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs]) for o in outs
    ]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_loop_equals_eager_layers(model_dir, dtype):
    llm = LLM(model_dir, dtype=dtype, enable_prefix_caching=False)
    runner = _decode_loop(llm)
    calls, loop = [], runner.decode_loop
    runner.decode_loop = _Counting(loop, calls)
    for prompts in (PROMPTS[:1], PROMPTS):  # batch 1 and batch 3
        calls.clear()
        with_loop = _run(llm, prompts)
        assert calls and set(calls) <= {1, 2, 3}, calls
        runner.decode_loop = None
        eager = _run(llm, prompts)
        runner.decode_loop = _Counting(loop, calls)
        assert with_loop == eager


def test_decode_loop_only_for_small_decode_steps(model_dir):
    llm = LLM(model_dir)
    runner = _decode_loop(llm)
    calls, loop = [], runner.decode_loop
    runner.decode_loop = _Counting(loop, calls)
    llm.generate(PROMPTS * 3, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert calls == [], "9 requests in a step: the eager path"
