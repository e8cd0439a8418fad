"""The attention seams: the backend selector, the forward context, the Attention layer's cache
binding and the KV-cache spec the runner sizes the cache from. A tiny random-weight model: the
cpu backend (C++ paged decode) and the torch reference (SDPA) give the same greedy tokens."""

import pytest
import torch
from kernel_utils import require_built

from pagedllm import LLM, SamplingParams
from pagedllm.attention.backends.cpu_attn import CPUAttentionBackend
from pagedllm.attention.backends.cpu_attn import kernels as cpu_kernels
from pagedllm.attention.backends.torch_sdpa import TorchSDPABackend
from pagedllm.attention.kv_cache_spec import FullAttentionSpec
from pagedllm.attention.layer import Attention, bind_kv_cache, get_kv_cache_spec
from pagedllm.attention.selector import get_attn_backend
from pagedllm.forward_context import get_forward_context, set_forward_context
from pagedllm.models.hf_config import head_dim_of


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from pagedllm.models.random_model import make_random_model

    return str(make_random_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", initializer_range=0.2))


def test_selector():
    fp32 = torch.float32
    want = CPUAttentionBackend if cpu_kernels.cpu_decode_supported(fp32) else TorchSDPABackend
    assert type(get_attn_backend("cpu", fp32, "torch")) is want
    assert get_attn_backend("cpu", fp32, "torch") is get_attn_backend(torch.device("cpu"), fp32, "torch")
    assert type(get_attn_backend("cpu", torch.float16, "torch")) is want  # float16 pages too
    assert type(get_attn_backend("cpu", torch.float64, "torch")) is TorchSDPABackend  # no float64 kernel
    with pytest.raises(ValueError, match="attention backend must be one of"):
        get_attn_backend("cpu", fp32, "flash")
    with pytest.raises(ValueError, match="cpu attention backend needs"):
        get_attn_backend("cpu", torch.float64, "cpu")


def test_triton_selected():
    pytest.importorskip("triton")
    backend = get_attn_backend("cpu", torch.float32, "triton")
    assert backend.name == "triton" and backend.supports_cuda_graphs


def test_forward_context():
    with pytest.raises(RuntimeError, match="no forward context"):
        get_forward_context()
    with set_forward_context("outer"):
        with set_forward_context("inner"):
            assert get_forward_context().attn_metadata == "inner"
        assert get_forward_context().attn_metadata == "outer"
    with pytest.raises(RuntimeError, match="no forward context"):
        get_forward_context()


def test_attention_layer_needs_cache_and_context():
    attn = Attention(num_heads=4, head_dim=8, scale=8**-0.5, num_kv_heads=2)
    q, kv = torch.randn(3, 4, 8), torch.randn(3, 2, 8)
    with pytest.raises(RuntimeError, match="no KV cache"):
        attn(q, kv, kv)
    cache = [(torch.zeros(32, 2, 8), torch.zeros(32, 2, 8))]
    bind_kv_cache(attn, cache)
    with pytest.raises(RuntimeError, match="no forward context"):
        attn(q, kv, kv)
    meta = attn.backend.build_metadata(
        torch.tensor([0, 3], dtype=torch.int32),
        torch.tensor([3], dtype=torch.int32),
        torch.tensor([[1, 0]], dtype=torch.int32),
        torch.arange(16, 19),
        16,
    )
    with set_forward_context(meta):
        out = attn(q, kv, kv)
    assert out.shape == (3, 4, 8) and torch.equal(cache[0][0][16:19], kv)
    with pytest.raises(ValueError, match="2 KV caches for 1 attention layers"):
        bind_kv_cache(attn, cache * 2)
    bind_kv_cache(attn, [])
    assert attn.kv_cache is None


def test_kv_cache_spec_sizes_the_cache(tiny_dir):
    llm = LLM(tiny_dir)
    runner = llm.llm_engine.core.model_executor.driver_worker.model_runner
    mc = runner.config.model_config
    head_dim = head_dim_of(mc.hf_config)
    specs = get_kv_cache_spec(runner.model, runner.block_size, runner.dtype)
    assert list(specs) == [f"layers.{i}.self_attn.attn" for i in range(mc.num_layers)]
    assert set(specs.values()) == {FullAttentionSpec(runner.block_size, mc.num_kv_heads, head_dim, runner.dtype)}
    assert runner.kv_bytes_per_block() == 2 * mc.num_layers * runner.block_size * mc.num_kv_heads * head_dim * 4
    k, v = runner.kv_caches[0]
    assert k.shape == v.shape and k.shape[1:] == (mc.num_kv_heads, head_dim)
    layer = runner.model.layers[0].self_attn.attn
    assert layer.kv_cache[0] is k and layer.backend is runner.attn_backend


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cpu_and_torch_backends_same_greedy_tokens(tiny_dir, monkeypatch, dtype):
    """The engine's CPU backend, and the SDPA reference the selector falls back to where the C++
    kernel does not build: same greedy tokens over prefills and decodes of 1 and 4 requests."""
    require_built(cpu_kernels.decode_kernel())  # a kernel that does not build fails (skip: no compiler)
    assert cpu_kernels.cpu_decode_supported(getattr(torch, dtype))
    prompts = [[(7 * i + n) % 400 + 3 for i in range(n)] for n in (5, 17, 2, 33)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def generate(expected_backend):
        llm = LLM(tiny_dir, max_num_batched_tokens=24, dtype=dtype)
        assert llm.llm_engine.core.model_executor.driver_worker.model_runner.attn_backend.name == expected_backend
        return [
            [
                o.outputs[0].token_ids
                for o in llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
            ]
            for batch in (prompts[:1], prompts)
        ]

    by_pages = generate("cpu")
    monkeypatch.setattr(cpu_kernels, "cpu_decode_supported", lambda dtype: False)
    assert generate("torch") == by_pages
