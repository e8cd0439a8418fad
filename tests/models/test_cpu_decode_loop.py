"""The C++ decode loop (models/cpu_decode_loop.py) equals the eager layers bit for bit: the same
greedy tokens and the same logprobs, to the last bit, in float32 and bfloat16, at 1-3 requests
(and at 1-8 rows of verification steps, tests/engine/test_spec_decode.py); the same hidden
states at 9, 16 and 64 rows, where both take oneDNN's packed linears (in bfloat16: bf16_pair_linear
on the pair layout up to 16 rows in the AVX512-BF16 build, and at every row count where oneDNN
has no bf16 kernels); a step with a prefill takes the eager path."""

import pytest
import torch
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
    from pagedllm.models.cpu_ops import cpu_ops
    from pagedllm.models.layers.cpu_bf16_pair_linear import CPUBf16PairLinearMethod, pair_linear_supported
    from pagedllm.models.layers.cpu_packed_linear import bf16_pairs_native, packed_linear_supported

    runner = llm.llm_engine.core.model_executor.driver_worker.model_runner
    model = runner.model
    if not envs.PAGEDLLM_CPU_DECODE_LOOP:  # as the engine reads it
        pytest.skip("the decode loop is turned off here (PAGEDLLM_CPU_DECODE_LOOP=0)")
    dtype = model.norm.weight.dtype
    pairs = not packed_linear_supported(dtype) and pair_linear_supported(dtype, cpu_ops())
    if not packed_linear_supported(dtype) and not pairs:
        pytest.skip(f"no oneDNN {dtype} linear here (this torch build or CPU): the decode loop needs it")
    for ext in (cpu_ops, decode_kernel, decode_loop_ext):
        require_built(ext())
    assert runner.decode_loop is not None, "the extensions are built, yet the engine did not enable the loop"
    # bfloat16 where oneDNN has no bf16 kernels (AVX2-only CPUs): the loop takes the pair kernel's linears
    assert runner.decode_loop.large_pairs == pairs
    # bfloat16 in the AVX512-BF16 build: the pair kernel up to 16 rows, oneDNN's above
    assert runner.decode_loop.small_pairs == (dtype == torch.bfloat16 and bf16_pairs_native(cpu_ops()))
    assert pairs == (type(model.layers[0].mlp.down_proj.linear_method) is CPUBf16PairLinearMethod)
    return runner


def _run(llm, prompts, params=SamplingParams(temperature=0, max_tokens=24, logprobs=3, ignore_eos=True)):
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


class _Checked:
    """The loop, each call checked against the eager layers on the same inputs (the eager path
    rewrites the same K/V), recording the rows of each call."""

    def __init__(self, runner, calls):
        self.runner, self.loop, self.calls, self.applies = runner, runner.decode_loop, calls, runner.decode_loop.applies

    def __call__(self, input_ids, positions):
        self.calls.append(input_ids.shape[0])
        out = self.loop(input_ids, positions)
        assert torch.equal(out, self.runner.model(input_ids, positions)), input_ids.shape[0]
        return out


# Shared by every prompt of the many-row test: 2+ full KV blocks the prefix cache serves.
PREAMBLE = (
    "You are a careful assistant. Continue each text below in plain English, in the style it"
    " starts in, without lists, headings or any remark about the task itself. Text: "
)


def _run_from_preamble(llm, prompts, params):
    """The prompts' outputs, from the same cache state whatever ran before: the prefix cache
    emptied, then the preamble's blocks cached by a request of its own."""
    llm.llm_engine.core.scheduler.kv_cache_manager.block_pool.reset_prefix_cache()
    llm.generate([PREAMBLE], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return _run(llm, prompts, params)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_loop_equals_eager_layers_at_many_rows(model_dir, dtype):
    """9, 16 and 64 requests decoding together (the packed linears' rows, above linear_small's),
    prefix caching on (the prompts' shared preamble served from the cache): each loop step's
    hidden states are the eager layers' on the same inputs, and the run's tokens and logprobs
    are those of the engine without the loop."""
    llm = LLM(model_dir, dtype=dtype, enable_prefix_caching=True, max_num_seqs=64)
    runner = _decode_loop(llm)
    loop = runner.decode_loop
    prompts = [f"{PREAMBLE}{p} ({i})" for i in range(22) for p in PROMPTS][:64]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    for n in (9, 16, 64):
        calls = []
        runner.decode_loop = _Checked(runner, calls)
        with_loop = _run_from_preamble(llm, prompts[:n], params)
        assert set(calls) == {n}, calls  # every decode step, all n requests in it (the preamble's: a prefill)
        runner.decode_loop = None
        eager = _run_from_preamble(llm, prompts[:n], params)
        runner.decode_loop = loop
        assert with_loop == eager


def test_decode_loop_takes_all_decode_steps_only(model_dir):
    """9 requests in 64-token steps: the first steps mix prefill chunks and decodes (the eager
    path's), the later ones are all decode, 9 rows (the loop's). An all-decode step of
    LARGE_ROWS rows is the eager path's where the float32 linears take F.linear there (no AVX-512)."""
    from pagedllm.models.layers.cpu_packed_linear import CPUPackedLinearMethod, cpu_has_avx512

    llm = LLM(model_dir, max_num_batched_tokens=64, max_num_seqs=16)
    runner = _decode_loop(llm)
    loop, seen, metas = runner.decode_loop, [], []

    def applies(meta, num_tokens):
        seen.append((meta.all_decode, num_tokens, loop.applies(meta, num_tokens)))
        metas.append(meta)
        return seen[-1][2]

    runner.decode_loop = _Counting(loop, [])
    runner.decode_loop.applies = applies
    prompts = [p * 4 for p in PROMPTS * 3]  # 9 prompts of 24-52 tokens: more than one 64-token step
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert any(not all_decode for all_decode, _, _ in seen), seen
    assert all(took == all_decode for all_decode, _, took in seen), seen
    assert (True, 9, True) in seen, seen
    large = CPUPackedLinearMethod.LARGE_ROWS
    assert loop.large_rows == (None if cpu_has_avx512() else large)
    decode_meta = metas[[s[2] for s in seen].index(True)]
    assert loop.applies(decode_meta, large - 1)
    assert loop.applies(decode_meta, large) == cpu_has_avx512()
