"""The GPU path's engine pieces, run on the CPU: the Triton attention backend inside the model
runner (under Triton's interpreter), the padded static-buffer decode path that CUDA graphs
replay, device / dtype resolution, CUDA-graph sizes and the KV-cache memory budget.

The model is a random-weight directory in a tiny Llama shape (models/random_model.py): the
interpreter runs each kernel program in numpy, too slow for the default model. The reference
is transformers' greedy generate on the same directory, token for token.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton): GPU path untested")

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.config import cuda_graph_ladder, mixed_graph_ladder, resolve_dtype  # noqa: E402
from pagedllm.engine.arg_utils import EngineArgs  # noqa: E402
from pagedllm.worker.memory import (
    GiB,
    MemorySnapshot,
    dummy_step_layout,
    kv_cache_budget,  # noqa: E402
    profile_by_delta,
)

MAX_TOKENS = 12
PROMPT_LENGTHS = [1, 3, 9, 16, 17, 40]  # across the 16-token block boundary


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from pagedllm.models.random_model import make_random_model

    # A wider init than a real checkpoint's, so that the logits are peaked and greedy
    # decoding does not sit on near-ties.
    return str(make_random_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", initializer_range=0.2))


@pytest.fixture(scope="module")
def prompts():
    return [[(13 * i + n) % 500 + 3 for i in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(tiny_dir, prompts):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [
            hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
            )[0, len(p) :].tolist()
            for p in prompts
        ]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _generate(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_triton_backend_engine_equals_transformers(tiny_dir, prompts, reference):
    """Chunks of 32 tokens: steps mix prefill chunks (with and without cached past) and decodes."""
    llm = LLM(tiny_dir, attention_backend="triton", max_num_batched_tokens=32)
    runner = llm.llm_engine.core.model_executor.driver_worker.model_runner
    assert runner.attn_backend.name == "triton" and runner.graphs is None  # no GPU: no graphs
    assert _generate(llm, prompts) == reference


def test_padded_decode_graph_path_equals_transformers(tiny_dir, prompts, reference):
    """The static-buffer path a CUDA graph replays, run eagerly (capture=False): decode batches
    of 6, 5, ... requests padded to the captured sizes 8, 4, 2, 1; padding rows write nothing.
    A graph's metadata is sized for max_model_len (its split-K count follows it): 128 keeps two
    splits, most of them empty, without the interpreter paying for the tiny model's 1024."""
    from pagedllm.worker.cuda_graph import StepGraphs

    llm = LLM(tiny_dir, attention_backend="triton", max_num_batched_tokens=32, max_model_len=128)
    runner = llm.llm_engine.core.model_executor.driver_worker.model_runner
    runner.graphs = graphs = StepGraphs(runner, [1, 2, 4, 8], capture=False)
    seen, run = [], graphs.run
    graphs.run = lambda inputs: seen.append(len(inputs.req_ids)) or run(inputs)
    assert _generate(llm, prompts) == reference
    assert any(graphs.padded_size(n) > n for n in seen), f"no padded step among batch sizes {seen}"
    # The padding slots were never written: the cache still has zeros where no request wrote.
    pool = llm.llm_engine.core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    k0 = runner.kv_caches[0][0]
    assert torch.all(k0[: runner.block_size] == 0), "the null block was written"


def test_padded_mixed_graph_path_equals_transformers(tiny_dir, prompts, reference):
    """The static-buffer path of cudagraph_mode FULL, run eagerly (capture=False): steps that
    mix prefill chunks and decodes padded to 16, 24 or 32 tokens over up to 32 requests (most
    of them padding requests that own no token), all-decode steps to the decode sizes; padding
    tokens write nothing."""
    from pagedllm.worker.cuda_graph import CudaGraphs

    llm = LLM(tiny_dir, attention_backend="triton", max_num_batched_tokens=32, max_model_len=128)
    runner = llm.llm_engine.core.model_executor.driver_worker.model_runner
    runner.graphs = graphs = CudaGraphs(runner, [1, 2, 4, 8], mixed_graph_ladder(32), capture=False)
    assert graphs.mixed.sizes == [16, 24, 32] and graphs.mixed.max_reqs == 32
    seen, run = [], graphs.run
    graphs.run = lambda inputs: (
        seen.append((graphs.taken.mixed, len(inputs.input_ids), inputs.max_query_len)) or run(inputs)
    )
    assert _generate(llm, prompts) == reference
    mixed = [(n, q) for is_mixed, n, q in seen if is_mixed]
    assert any(q > 1 and graphs.mixed.padded_size(n) > n for n, q in mixed), f"no padded mixed step: {seen}"
    assert any(not is_mixed for is_mixed, _, _ in seen), "no decode graph step"
    pool = llm.llm_engine.core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    assert torch.all(runner.kv_caches[0][0][: runner.block_size] == 0), "the null block was written"


def test_padded_sizes():
    from types import SimpleNamespace

    from pagedllm.worker.cuda_graph import StepGraphs

    g = StepGraphs.__new__(StepGraphs)
    g.sizes, g.max_size, g.mixed = [1, 2, 4, 8, 16], 16, False
    assert [g.padded_size(n) for n in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert g.can_run(SimpleNamespace(max_query_len=1, req_ids=["a"] * 16))
    assert not g.can_run(SimpleNamespace(max_query_len=1, req_ids=["a"] * 17))
    assert not g.can_run(SimpleNamespace(max_query_len=2, req_ids=["a"]))  # a prefill chunk
    g.mixed = True  # by token count, whatever the split
    assert g.can_run(SimpleNamespace(max_query_len=16, input_ids=[0] * 16, req_ids=["a"]))
    assert not g.can_run(SimpleNamespace(max_query_len=17, input_ids=[0] * 17, req_ids=["a"]))


def test_mixed_graph_ladder():
    assert mixed_graph_ladder(32) == [16, 24, 32]
    assert mixed_graph_ladder(8192) == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    assert mixed_graph_ladder(300)[-3:] == [192, 256, 300]
    assert mixed_graph_ladder(8) == [8]


def test_cuda_graph_ladder():
    assert cuda_graph_ladder(1) == [1, 2, 4, 8]
    assert cuda_graph_ladder(20) == [1, 2, 4, 8, 16, 24]
    assert cuda_graph_ladder(128)[-3:] == [112, 120, 128]
    assert cuda_graph_ladder(4096)[-1] == 512


def test_dtype_auto_resolution():
    assert resolve_dtype("auto", {"torch_dtype": "bfloat16"}, "cpu") == "float32"
    assert resolve_dtype("auto", {"torch_dtype": "bfloat16"}, "cuda") == "bfloat16"
    assert resolve_dtype("auto", {"dtype": "float16"}, "cuda") == "float16"  # transformers 5 key
    assert resolve_dtype("auto", {"torch_dtype": "float32"}, "cuda") == "float32"
    assert resolve_dtype("auto", {}, "cuda") == "bfloat16"
    assert resolve_dtype("float16", {"torch_dtype": "bfloat16"}, "cuda") == "float16"


def test_engine_args_device_choices(tiny_dir):
    cfg = EngineArgs(model=tiny_dir).create_engine_config()
    assert (cfg.device_config.device, cfg.device_config.attention_backend) == ("cpu", "torch")
    assert cfg.model_config.dtype == "float32" and cfg.device_config.cuda_graph_sizes == []
    assert cfg.device_config.mixed_graph_sizes == []
    cfg = EngineArgs(model=tiny_dir, attention_backend="triton").create_engine_config()
    assert cfg.device_config.attention_backend == "triton"
    for kwargs, field in [
        ({"device": "tpu"}, "device"),
        ({"attention_backend": "flash"}, "attention_backend"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
        ({"cudagraph_mode": "PIECEWISE"}, "cudagraph_mode"),
    ]:
        with pytest.raises(ValueError, match=field):
            EngineArgs(model=tiny_dir, **kwargs).create_engine_config()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda'"):
            EngineArgs(model=tiny_dir, device="cuda").create_engine_config()


def test_cli_gpu_flags():
    import argparse

    from pagedllm.entrypoints.cli import add_engine_args, engine_args_from

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = engine_args_from(
        p.parse_args(
            ["--device", "cpu", "--attention-backend", "triton", "--gpu-memory-utilization", "0.8", "--enforce-eager"]
        )
    )
    assert (args.device, args.attention_backend, args.gpu_memory_utilization, args.enforce_eager) == (
        "cpu",
        "triton",
        0.8,
        True,
    )
    d = engine_args_from(p.parse_args([]))
    assert (d.device, d.attention_backend, d.gpu_memory_utilization, d.enforce_eager) == ("auto", "auto", 0.9, False)


def test_kv_cache_budget():
    # 80 GiB x 0.9 = 72 GiB, less 2.5 weights, 1.5 activations, 0.5 context -> 67.5 GiB
    assert kv_cache_budget(80 * GiB, 0.9, int(2.5 * GiB), int(1.5 * GiB), GiB // 2) == int(67.5 * GiB)
    with pytest.raises(ValueError, match="gpu_memory_utilization 0.05"):
        kv_cache_budget(80 * GiB, 0.05, int(2.5 * GiB), int(1.5 * GiB), GiB // 2)


def test_profile_by_delta_ignores_memory_in_use_before():
    """A second engine in a process where another holds 23 GiB (torch) and another process
    3 GiB: only what this engine adds counts as its weights, activations and non-torch memory."""
    total, ctx, other_engine, other_proc = 80 * GiB, GiB // 2, 23 * GiB, 3 * GiB

    def snap(allocated, reserved, non_torch, peak=0):
        return MemorySnapshot(
            total=total,
            free=total - reserved - non_torch,
            torch_allocated=allocated,
            torch_reserved=reserved,
            torch_peak=peak,
        )

    base = snap(other_engine, other_engine, ctx + other_proc)
    loaded = snap(other_engine + 2 * GiB, other_engine + 2 * GiB, ctx + other_proc)
    before = snap(other_engine + 3 * GiB, other_engine + 3 * GiB, ctx + other_proc)  # + temporary cache
    after = snap(
        other_engine + 2 * GiB, other_engine + 2 * GiB, ctx + other_proc + GiB // 4, peak=other_engine + 4.5 * GiB
    )
    prof = profile_by_delta(base, loaded, before, after, 0.5)
    assert (prof.weights, prof.peak_activation, prof.non_torch) == (2 * GiB, int(1.5 * GiB), GiB // 4)
    assert prof.in_use_before == other_engine + ctx + other_proc
    assert prof.kv_cache == 40 * GiB - 2 * GiB - int(1.5 * GiB) - GiB // 4
    # the old arithmetic (allocated now = weights, used - reserved = non-torch) would have
    # charged the other engine's 23 GiB as weights and the other process as non-torch:
    assert prof.kv_cache - (40 * GiB - before.torch_allocated - after.non_torch) > 25 * GiB
    # the share asked for is not free: a ValueError that says who holds the device
    with pytest.raises(ValueError, match=r"gpu_memory_utilization 0.8 .* 26.50 GiB are in use"):
        profile_by_delta(base, loaded, before, after, 0.8)


@pytest.mark.parametrize("tokens,reqs,bs", [(2048, 128, 16), (2048, 1, 16), (100, 7, 32), (5, 5, 16)])
def test_dummy_step_layout(tokens, reqs, bs):
    import numpy as np

    qsl, seq_lens, block_table, slots, positions, num_blocks = dummy_step_layout(tokens, reqs, bs)
    assert qsl[-1] == tokens and len(seq_lens) == reqs and seq_lens.sum() == tokens
    assert len(np.unique(slots)) == tokens and slots.min() >= bs  # the null block untouched
    assert slots.max() < num_blocks * bs and block_table.max() < num_blocks
    for r in range(reqs):  # each token at its request's block for its position
        pos = positions[qsl[r] : qsl[r + 1]]
        assert list(pos) == list(range(seq_lens[r]))
        assert np.all(slots[qsl[r] : qsl[r + 1]] // bs == block_table[r, pos // bs])
