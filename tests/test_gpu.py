"""The CUDA path on a real GPU: Triton kernels on the device, decode CUDA graphs, memory
profiling, float32 and bfloat16. Skipped, with the reason, where torch sees no CUDA device
(the CPU tests in test_triton_runner.py cover what runs without one).

Models: random-weight directories (models/random_model.py), made here; no download.
float32: greedy output equals transformers' on the same GPU token for token (ties allowed as in
test_greedy_equality: where the two first differ, the reference's top-2 logits are within 1e-4).
bfloat16: different kernels round differently, so greedy paths may part after a near-tie; the
stated tolerance is top-1 agreement >= 90 % of positions when transformers, in bfloat16,
scores our greedy continuation teacher-forced.
"""

import gc
import re

import pytest
import torch
from spec_decode.test_mtp_proposer import MTP, predictable_dir  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

MAX_TOKENS = 32
TIE_EPS = 1e-4
PROMPT_LENGTHS = [1, 5, 16, 17, 63, 130, 300]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from pagedllm.models.random_model import make_random_model

    return str(make_random_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", initializer_range=0.2))


@pytest.fixture(scope="module")
def prompts():
    return [[(13 * i + n) % 500 + 3 for i in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture
def make_llm():
    """LLM(...) whose GPU memory is given back after the test, before the next one profiles
    memory. A failed test's traceback keeps its frame, and so its engine, alive: the runner's
    tensors are dropped here by hand, then collected (del + gc + empty_cache)."""
    from pagedllm import LLM

    engines = []
    yield lambda *args, **kwargs: engines.append(LLM(*args, **kwargs)) or engines[-1]
    while engines:
        llm = engines.pop()
        llm.shutdown()
        runner = llm.llm_engine.core.model_executor.driver_worker.model_runner
        runner.graphs = runner.model = None
        runner.kv_caches, runner.cpu_caches = [], []
        del llm, runner
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _hf(model_dir, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda").eval()


def _generate(llm, prompts):
    from pagedllm import SamplingParams

    # EOS masked for all MAX_TOKENS, as transformers' min_new_tokens does for the reference
    # (ignore_eos only keeps a request running past EOS; EOS can still be chosen, as in vLLM).
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference_fp32(tiny_dir, prompts):
    return _hf_greedy(_hf(tiny_dir, torch.float32), prompts)


def _hf_greedy(hf, prompts):
    """transformers' greedy continuation of each prompt on the GPU -> (tokens, top-2 gaps)."""
    refs = []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(
                torch.tensor([p], device="cuda"),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                output_logits=True,
                return_dict_in_generate=True,
            )
            gaps = [float(lg[0].float().topk(2).values.diff().abs()) for lg in out.logits]
            refs.append((out.sequences[0, len(p) :].tolist(), gaps))
    return refs


def _assert_equal(got, reference):
    for i, (ours, (ref, gaps)) in enumerate(zip(got, reference)):
        j = next((j for j, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        assert j is None or gaps[j] < TIE_EPS, f"prompt {i}: token {j} differs, gap {gaps[j]:.3g}"


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_float32_greedy_equals_transformers(make_llm, tiny_dir, prompts, reference_fp32, enforce_eager):
    llm = make_llm(
        tiny_dir, dtype="float32", enforce_eager=enforce_eager, max_num_batched_tokens=64, gpu_memory_utilization=0.3
    )
    runner = llm.llm_engine.core.model_executor.driver_worker.model_runner
    assert runner.device.type == "cuda" and runner.attn_backend.name == "triton"
    assert (runner.graphs is None) == enforce_eager
    if runner.graphs is not None:
        replays, run = [], runner.graphs.run
        runner.graphs.run = lambda inputs: replays.append(len(inputs.req_ids)) or run(inputs)
    _assert_equal(_generate(llm, prompts), reference_fp32)
    if not enforce_eager:
        assert replays, "no decode step replayed a CUDA graph"


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_async_scheduling_equals_transformers(make_llm, tiny_dir, prompts, reference_fp32, enforce_eager):
    """--async-scheduling on the GPU: the next step's input token comes from the device tensor
    of the step in flight (graph replay and eager), a small cache forces swap preemption, and
    the pinned staging buffers feed the graphs."""
    llm = make_llm(
        tiny_dir,
        dtype="float32",
        enforce_eager=enforce_eager,
        async_scheduling=True,
        num_gpu_blocks=30,
        num_cpu_blocks=64,
        preemption_mode="swap",
        max_num_batched_tokens=64,
    )
    runner = llm.llm_engine.core.model_executor.driver_worker.model_runner
    outputs = runner.async_outputs
    fill, filled = outputs.fill_placeholders, []
    outputs.fill_placeholders = lambda ids, inputs: fill(ids, inputs) or filled.append(len(outputs.filled))
    _assert_equal(_generate(llm, prompts), reference_fp32)
    assert sum(filled) > 0, "no step took its input token from the step in flight"
    assert llm.llm_engine.num_preemptions > 0
    pool = llm.llm_engine.core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1, "a KV block leaked"


def test_swap_preemption_on_gpu(make_llm, tiny_dir, prompts, reference_fp32):
    """A cache too small for all requests: blocks go to pinned host memory and come back."""
    llm = make_llm(
        tiny_dir,
        dtype="float32",
        num_gpu_blocks=30,
        num_cpu_blocks=64,
        preemption_mode="swap",
        max_num_batched_tokens=128,
    )
    _assert_equal(_generate(llm, prompts), reference_fp32)
    assert llm.llm_engine.num_preemptions > 0


def test_bfloat16_top1_agreement(make_llm, tiny_dir, prompts):
    llm = make_llm(tiny_dir, dtype="bfloat16", gpu_memory_utilization=0.3)
    assert llm.llm_engine.core.model_executor.driver_worker.model_runner.dtype == torch.bfloat16
    got = _generate(llm, prompts)
    hf = _hf(tiny_dir, torch.bfloat16)
    agree = total = 0
    with torch.inference_mode():
        for p, ours in zip(prompts, got):
            ids = torch.tensor([p + ours], device="cuda")
            pred = hf(ids).logits[0, len(p) - 1 : -1].argmax(-1).tolist()  # next-token choices
            agree += sum(a == b for a, b in zip(pred, ours))
            total += len(ours)
    assert agree / total >= 0.9, f"bf16 top-1 agreement {agree}/{total}"


def test_memory_profiling_sizes_the_cache(make_llm, tiny_dir, caplog):
    import logging

    caplog.set_level(logging.INFO)
    util = 0.25
    llm = make_llm(tiny_dir, dtype="float32", gpu_memory_utilization=util)
    core = llm.llm_engine.core
    total = torch.cuda.mem_get_info()[1]
    kv_bytes = core.num_blocks * core.model_executor.kv_bytes_per_block()
    assert 0 < kv_bytes < util * total
    # most of the allowed share goes to the cache (the tiny model's weights are ~2 MB)
    assert kv_bytes > 0.5 * util * total - torch.cuda.memory_reserved()
    text = caplog.text
    assert re.search(r"memory profile \(2048 tokens, 128 requests\)", text)
    assert re.search(rf"KV cache: {core.num_blocks} blocks of 16 tokens", text)


def test_kernels_on_device_match_torch_reference():
    """The Triton kernels on the GPU against the torch backend, a mixed batch with GQA 4."""
    import numpy as np

    from pagedllm.attention.backends.torch_sdpa import paged_attention as torch_sdpa
    from pagedllm.attention.backends.torch_sdpa.metadata import build_attention_metadata
    from pagedllm.attention.backends.triton_attn import paged_attention as tb
    from pagedllm.attention.backends.triton_attn.metadata import build_triton_metadata

    g = torch.Generator().manual_seed(0)
    bs, H, Hkv, D = 16, 8, 2, 64
    reqs = [(0, 37), (50, 1), (300, 1), (17, 20), (1000, 1)]  # (cached, new)
    nblocks = sum(-(-(c + n) // bs) for c, n in reqs) + 1
    perm = torch.randperm(nblocks - 1, generator=g) + 1
    block_rows, slots, qsl, seq_lens, used = [], [], [0], [], 0
    width = max(-(-(c + n) // bs) for c, n in reqs)
    for c, n in reqs:
        nb = -(-(c + n) // bs)
        row = perm[used : used + nb].tolist()
        used += nb
        block_rows.append(row + [0] * (width - nb))
        slots += [row[p // bs] * bs + p % bs for p in range(c, c + n)]
        qsl.append(qsl[-1] + n)
        seq_lens.append(c + n)
    T = qsl[-1]
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (H, Hkv, Hkv))
    kc, vc = (torch.randn(nblocks * bs, Hkv, D, generator=g) for _ in range(2))
    bt, qsl_np, sl_np = (
        np.array(block_rows, dtype=np.int32),
        np.array(qsl, dtype=np.int32),
        np.array(seq_lens, dtype=np.int32),
    )
    slot_t = torch.tensor(slots)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    ref = torch_sdpa.paged_attention(
        q, k, v, ref_kc, ref_vc, build_attention_metadata(qsl_np, sl_np, bt, bs, slot_t), D**-0.5
    )
    meta = build_triton_metadata(qsl_np, sl_np, bt, bs, slot_t, device="cuda")
    kd, vd = kc.cuda(), vc.cuda()
    out = tb.paged_attention(q.cuda(), k.cuda(), v.cuda(), kd, vd, meta, D**-0.5)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kd.cpu(), ref_kc)


def test_memory_profile_of_a_second_engine_in_one_process(make_llm, tiny_dir):
    """Two engines alive in one process (a notebook): the second's weights are its own ~2 MB,
    not the first's KV cache, and its cache gets about the same share as the first's."""
    first = make_llm(tiny_dir, dtype="float32", gpu_memory_utilization=0.2, enforce_eager=True)
    second = make_llm(tiny_dir, dtype="float32", gpu_memory_utilization=0.2, enforce_eager=True)
    profiles = [llm.llm_engine.core.model_executor.driver_worker.model_runner.memory_profile for llm in (first, second)]
    weights = sum(
        p.numel() * p.element_size()
        for p in first.llm_engine.core.model_executor.driver_worker.model_runner.model.parameters()
    )
    for prof in profiles:
        assert weights <= prof.weights < weights + (8 << 20), prof
    assert profiles[1].in_use_before > profiles[0].in_use_before + 0.9 * profiles[0].kv_cache
    assert abs(profiles[1].kv_cache - profiles[0].kv_cache) < 0.02 * profiles[0].requested, profiles


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mixed_step_graphs_equal_transformers(make_llm, tiny_dir, prompts, reference_fp32, async_scheduling):
    """cudagraph_mode FULL (the default): steps that mix prefill chunks and decodes replay the
    graph of their padded token count (here 16..64 tokens), all-decode steps the decode graphs;
    no step of this run is eager."""
    llm = make_llm(
        tiny_dir,
        dtype="float32",
        max_num_batched_tokens=64,
        max_num_seqs=8,
        async_scheduling=async_scheduling,
        gpu_memory_utilization=0.3,
    )
    runner = llm.llm_engine.core.model_executor.driver_worker.model_runner
    graphs = runner.graphs
    assert graphs.mixed is not None and graphs.mixed.sizes == [16, 24, 32, 48, 64]
    replays, forward, run = [], runner._forward, graphs.run
    graphs.run = lambda inputs: (
        replays.append((graphs.taken.mixed, len(inputs.input_ids), inputs.max_query_len)) or run(inputs)
    )
    eager = []
    runner._forward = lambda inputs, meta: (
        (meta is not None and eager.append(len(inputs.input_ids))) or forward(inputs, meta)
    )
    _assert_equal(_generate(llm, prompts), reference_fp32)  # steps of 64 mixing chunks and decodes
    _assert_equal(_generate(llm, [prompts[1], prompts[3]]), [reference_fp32[1], reference_fp32[3]])
    mixed = [(n, q) for is_mixed, n, q in replays if is_mixed]
    assert any(q > 1 and graphs.mixed.padded_size(n) > n for n, q in mixed), replays  # 22 -> 24
    assert any(not is_mixed for is_mixed, _, _ in replays), "no decode graph replayed"
    assert not eager, f"eager steps of {eager} tokens"
    pool = llm.llm_engine.core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1, "a KV block leaked"


def test_cudagraph_mode_decode_only_leaves_mixed_steps_eager(make_llm, tiny_dir, prompts, reference_fp32):
    llm = make_llm(
        tiny_dir,
        dtype="float32",
        max_num_batched_tokens=64,
        cudagraph_mode="FULL_DECODE_ONLY",
        gpu_memory_utilization=0.3,
    )
    runner = llm.llm_engine.core.model_executor.driver_worker.model_runner
    assert runner.graphs.decode is not None and runner.graphs.mixed is None
    _assert_equal(_generate(llm, prompts), reference_fp32)


def test_gemma3_sliding_window_on_gpu(make_llm, tmp_path):
    """Gemma 3's interleaved sliding-window layers (window 8, two KV-cache groups) on the GPU:
    the Triton kernel's window, chunked prefill past the window; greedy equals transformers on
    the same GPU."""
    from models.test_qwen3 import make_hf_model
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    path, model = make_hf_model(
        tmp_path,
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_hidden_layers=4,
        query_pre_attn_scalar=16,
        max_position_embeddings=256,
    )
    prompts = [[(7 * i + n) % 250 + 3 for i in range(n)] for n in (3, 11, 30, 70)]
    refs = _hf_greedy(model.to("cuda"), prompts)
    llm = make_llm(path, dtype="float32", block_size=4, max_num_batched_tokens=16, gpu_memory_utilization=0.3)
    runner = llm.llm_engine.core.model_executor.driver_worker.model_runner
    assert runner.num_kv_cache_groups > 1 and runner.attn_backend.name == "triton"
    _assert_equal(_generate(llm, prompts), refs)


def test_mixtral_grouped_moe_on_gpu(make_llm, tmp_path):
    """Mixtral through the engine on the GPU: the grouped Triton expert matmuls in the forward
    (the CUDA path of FusedMoE), chunked prefill, graphs; greedy equals transformers."""
    from models.test_qwen3 import CHUNKED, hf_reference, make_hf_model, prompts
    from transformers import MixtralConfig, MixtralForCausalLM

    path, model = make_hf_model(
        tmp_path,
        MixtralConfig,
        MixtralForCausalLM,
        num_local_experts=8,
        intermediate_size=40,
        num_experts_per_tok=2,
        initializer_range=0.2,
    )
    ids = prompts()
    refs = hf_reference(model, ids)
    llm = make_llm(path, dtype="float32", gpu_memory_utilization=0.3, **CHUNKED)
    from pagedllm.models.layers.fused_moe import FusedMoE

    assert any(
        isinstance(m, FusedMoE) for m in llm.llm_engine.core.model_executor.driver_worker.model_runner.model.modules()
    )
    _assert_equal(_generate(llm, ids), [(r[:MAX_TOKENS], g) for r, g in refs])


def test_mtp_drafts_on_gpu(make_llm, predictable_dir):
    """DeepSeek-V3's MTP layer drafting on the GPU (MLA attention in Triton, the draft's eager
    forward, rejection sampling on the device): greedy equals transformers, drafts accepted."""
    from models.test_deepseek_v3 import hf_greedy, prompts_with_shared_prefix

    path, model, _, _ = predictable_dir
    ids = prompts_with_shared_prefix()[0]
    llm = make_llm(
        str(path),
        block_size=4,
        max_num_batched_tokens=8,
        dtype="float32",
        speculative_config=MTP,
        gpu_memory_utilization=0.3,
    )
    from pagedllm import SamplingParams

    outs = llm.generate(
        [{"prompt_token_ids": p} for p in ids],
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    stats = llm.llm_engine.core.scheduler.spec_decoding_stats
    assert stats.num_accepted_tokens > 10, stats
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model, ids)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2", "int8"])
def test_quantized_kv_cache_through_the_engine(make_llm, tiny_dir, prompts, kv):
    """--kv-cache-dtype on the GPU: greedy equals transformers on the same GPU whose attention
    sees K/V rounded as the cache stores them (per token and KV head: the row / (max|row| /
    the type's largest value), cast by torch; int8 rounded half away from zero), ties allowed."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}[kv]
    qmax = 127.0 if dtype == torch.int8 else torch.finfo(dtype).max

    def rounded(x):  # [B, Hkv, T, D]: each (token, head) row as stored, dequantized
        scale = (x.abs().amax(-1, keepdim=True) / qmax).clamp_min(1e-12)
        y = x / scale
        y = (torch.sign(y) * torch.floor(y.abs() + 0.5)).clamp(-127, 127) if dtype == torch.int8 else y.to(dtype)
        return y.float() * scale

    def attention(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, rounded(key), rounded(value), attention_mask, **kwargs)

    AttentionInterface.register(f"gpu_kv_{kv}", attention)
    hf = (
        AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32, attn_implementation=f"gpu_kv_{kv}")
        .to("cuda")
        .eval()
    )
    refs = _hf_greedy(hf, prompts)
    del hf
    llm = make_llm(tiny_dir, dtype="float32", kv_cache_dtype=kv, max_num_batched_tokens=64, gpu_memory_utilization=0.3)
    assert llm.llm_engine.core.model_executor.driver_worker.model_runner.kv_caches[0][0].dtype == dtype
    _assert_equal(_generate(llm, prompts), refs)
