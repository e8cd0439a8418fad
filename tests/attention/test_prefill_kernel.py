"""The C++ prefill kernel (csrc/prefill_attention.cpp's paged_prefill) against a float64 reference
computed here from the same cache contents: random page layouts (shuffled, non-contiguous
block tables), chunks of 1, 15, 17 and 513 tokens with and without a past, several requests in
one call, GQA ratios 1, 3 and 4, sliding windows, float32 / bfloat16 / float16 caches, every
build of the kernels this CPU runs. Then the engine, whose CPU backend sends prefill chunks
through the kernel, against transformers' greedy output.

Tolerances: the kernel sums in float32 from the cache's values and rounds its output once to
the cache's dtype. float32: 2e-5 (float32 sums over up to ~600 keys and the e^x polynomial's
1e-8). bfloat16 / float16: half a step of the output's rounding (2^-9 / 2^-12 relative) plus
the float32 error, so rtol 2^-8 / 2^-10 with the same atol (outputs are O(1)). The AVX-512
build's bfloat16 PV also rounds each softmax weight to bfloat16 (relative 2^-9, to nearest
even, so unbiased): an error of at most 2^-9 sum_j p_j |v_j| / sum_j p_j, in practice its
random sum over the keys, well inside the same 2^-8."""

import numpy as np
import pytest
import torch
from engine.test_greedy_equality import greedy_equality_prompts
from greedy_utils import assert_greedy_equal, hf_greedy_batched
from kernel_utils import paged_step, require_built, shuffled_block_table

from pagedllm.attention.backends.cpu_attn.kernels import prefill_kernel
from pagedllm.attention.backends.cpu_attn.paged_attention import paged_attention
from pagedllm.attention.backends.torch_sdpa.metadata import build_attention_metadata

TOL = {torch.float32: 2e-5, torch.bfloat16: 2**-8, torch.float16: 2**-10}

# (cached tokens, new tokens) per request of the step: prompts of odd lengths, chunks over a
# past, a one-token chunk over a past (a decode's shape).
REQUESTS = [(0, 1), (0, 15), (40, 17), (0, 513), (100, 33), (31, 1)]


def reference(q, kc, vc, table, bs, requests, scale, window):
    """float64 attention of each chunk's queries over its keys, gathered from the cache slot by
    slot through the block table -> [T, H, D] float64."""
    H, Hkv = q.shape[1], kc.shape[1]
    outs = []
    for row, (c, n) in enumerate(requests):
        pos = np.arange(c + n)
        first = max(c - window + 1, 0) if window else 0  # nothing before this is read
        keys = pos[first:]
        slots = torch.from_numpy(table[row, keys // bs].astype(np.int64) * bs + keys % bs)
        k = kc[slots].double().repeat_interleave(H // Hkv, dim=1)  # [L, H, D]
        v = vc[slots].double().repeat_interleave(H // Hkv, dim=1)
        qr = q[sum(m for _, m in requests[:row]) :][:n].double()  # [n, H, D]
        s = torch.einsum("ihd,jhd->hij", qr, k) * scale
        qpos, kpos = torch.arange(c, c + n)[:, None], torch.from_numpy(keys)[None, :]
        visible = kpos <= qpos
        if window:
            visible &= kpos > qpos - window
        s = s.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hij,jhd->ihd", torch.softmax(s, dim=-1), v))
    return torch.cat(outs)


# (query, cache) dtypes: a model's own, and a float32 model's bfloat16 cache (--kv-cache-dtype,
# each row widened exactly: float32's tolerance).
DTYPE_PAIRS = [(d, d) for d in TOL] + [(torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("dtype, cache_dtype", DTYPE_PAIRS, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize(
    "H, Hkv, D, bs, window",
    [
        (9, 3, 64, 16, 0),
        (4, 4, 64, 5, 0),
        (32, 8, 64, 16, 0),
        (8, 2, 128, 16, 0),
        (9, 3, 64, 16, 21),
        (4, 1, 32, 4, 64),
    ],
)
@pytest.mark.usefixtures("cpu_isa")  # every build of the kernels this CPU runs
def test_prefill_kernel_matches_float64_reference(dtype, cache_dtype, H, Hkv, D, bs, window):
    """All chunks in one call, q a strided view of a fused qkv output (as the layers pass it).
    The cache's blocks before each chunk's first window key are poisoned with NaN (freed and
    reused, as a sliding-window manager does): the kernel must not read them. Rows of the
    step that are not prefill chunks are left as they were."""
    kernel = require_built(prefill_kernel(dtype, D))
    rng = np.random.default_rng(H * 1000 + D + bs + window)
    torch.manual_seed(H + D + window)
    seq_lens = np.array([c + n for c, n in REQUESTS], dtype=np.int32)
    table, S = shuffled_block_table(seq_lens, bs, rng)
    T = sum(n for _, n in REQUESTS) + 2  # + 2 tokens that are no chunk's
    qkv = torch.randn(T, (H + 2 * Hkv) * D).to(dtype)
    q = qkv[:, : H * D].view(T, H, D)  # token stride (H + 2 Hkv) D
    kc, vc = torch.randn(S, Hkv, D).to(cache_dtype), torch.randn(S, Hkv, D).to(cache_dtype)
    if window:
        for row, (c, _) in enumerate(REQUESTS):
            dead = np.arange(max(c - window + 1, 0) // bs * bs)  # whole blocks before the window
            kc[table[row, dead // bs] * bs + dead % bs] = float("nan")
            vc[table[row, dead // bs] * bs + dead % bs] = float("nan")
    starts = np.cumsum([0] + [n for _, n in REQUESTS])[:-1] + 1  # token 0 and T-1: no chunk's
    i32 = lambda a: torch.tensor(np.asarray(a), dtype=torch.int32)  # noqa: E731
    out = torch.full((T, H, D), 7.0, dtype=dtype)
    kernel(q, kc, vc, out, i32(starts), i32([n for _, n in REQUESTS]), i32(seq_lens), i32(table), bs, D**-0.5, window)
    ref = reference(q[1:-1], kc, vc, table, bs, REQUESTS, D**-0.5, window)
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(out[1:-1].double(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert (out[0] == 7).all() and (out[-1] == 7).all()


@pytest.mark.usefixtures("cpu_isa")  # every build of the kernels this CPU runs
@pytest.mark.parametrize("window", [None, 21])
def test_cpu_backend_prefill_equals_torch_path(window):
    """paged_attention on a mixed step (decodes beside chunks with and without a past): the
    metadata for the kernel (prefill_by_pages) against the torch path's SDPA per chunk."""
    H, Hkv, D, bs = 9, 3, 64, 16
    require_built(prefill_kernel(torch.float32, D))
    rng = np.random.default_rng(5)
    q_lens = np.array([1, 17, 1, 40, 6])
    seq_lens = np.array([9, 17, 30, 120, 6], dtype=np.int32)
    table, S, qsl, slots = paged_step(q_lens, seq_lens, bs, rng)
    T = int(q_lens.sum())
    q, k, v = torch.randn(T, H, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
    outs = []
    for by_pages in (False, True):
        kc = torch.randn(S, Hkv, D, generator=torch.Generator().manual_seed(0))
        vc = torch.randn(S, Hkv, D, generator=torch.Generator().manual_seed(1))
        meta = build_attention_metadata(
            qsl, seq_lens, table, bs, slots, decode_by_pages=by_pages, prefill_by_pages=by_pages
        ).windowed(window)
        assert (meta.prefill_pages is not None) == by_pages
        if by_pages:
            assert meta.prefill_pages.q_len.tolist() == [17, 40, 6]
        outs.append(paged_attention(q, k, v, kc, vc, meta, D**-0.5))
    assert torch.isfinite(outs[0]).all()
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)


def test_prefill_kernel_refuses_what_it_cannot_take():
    """A head_dim that is not a multiple of 16 or a quantized cache dtype: no kernel (the caller
    keeps SDPA); mismatched dtypes (a float16 cache under float32 queries): an error naming them."""
    assert prefill_kernel(torch.float32, 72) is None
    assert prefill_kernel(torch.int8, 64) is None
    kernel = require_built(prefill_kernel(torch.float32, 64))
    q = torch.randn(4, 2, 64)
    kc = torch.randn(16, 2, 64, dtype=torch.float16)
    i32 = lambda a: torch.tensor(a, dtype=torch.int32)  # noqa: E731
    with pytest.raises(RuntimeError, match="dtype"):
        kernel(q, kc, kc, torch.empty_like(q), i32([0]), i32([4]), i32([4]), i32([[0]]), 16, 0.125, 0)


@pytest.mark.model
def test_engine_chunked_prefill_through_the_kernel_matches_transformers(model_dir, tokenizer, hf_model):
    """float32 engine on the CPU backend (its prefill chunks through the kernel), a token budget
    of 64 so the longer prompts are prefilled in chunks over their past: greedy output equals
    transformers' token for token (ties excepted, as in the greedy-equality suite)."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.attention.selector import get_attn_backend

    require_built(prefill_kernel(torch.float32, 64))
    assert get_attn_backend("cpu", torch.float32).prefill_by_pages
    prompts = greedy_equality_prompts(tokenizer)[::2]
    ref = hf_greedy_batched(hf_model, prompts, 24)
    llm = LLM(model_dir, max_num_batched_tokens=64, max_model_len=512)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False
    )
    assert_greedy_equal(outs, ref, "prefill kernel, budget=64")
