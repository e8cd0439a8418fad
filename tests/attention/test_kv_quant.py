"""The int8 / fp8 KV cache (attention/kv_quant.py): per-token-per-head scales.

- quantize_kv against the float rows it stores (int8: within half a step of the row's scale;
  fp8: within its mantissa's relative rounding) and an all-zero row decodes to zeros;
- the torch path on a quantized cache equals SDPA over the dequantized cache (a float64 loop
  here), and stays near the unquantized answer;
- the C++ decode kernel (float32 and bfloat16 queries, head_dim 64 / 128 / odd 80 on the
  scalar path) against the torch path's gathered decode on the same quantized pages;
- the Triton kernels under the interpreter: the same bytes and scales written, the same
  attention as the torch path (mixed prefill/decode batches, split-K, block sizes 16 / 32);
- the spec's bytes per block (the memory planner divides by them).
Unowned cache slots carry NaN scales: a kernel that reads outside its blocks fails.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import numpy as np
import pytest
import torch
from kernel_utils import require_built, shuffled_block_table

from pagedllm.attention.backends.cpu_attn import paged_attention as cpu_attn
from pagedllm.attention.backends.cpu_attn.kernels import decode_kernel
from pagedllm.attention.backends.torch_sdpa import paged_attention as torch_sdpa
from pagedllm.attention.backends.torch_sdpa.metadata import build_attention_metadata
from pagedllm.attention.kv_cache_spec import FullAttentionSpec
from pagedllm.attention.kv_quant import QMAX, dequantize_kv, quantize_kv, resolve_kv_cache_dtype

KV_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
# fp8's relative rounding: half an ulp of its mantissa (3 bits e4m3, 2 bits e5m2); int8 absolute
REL_STEP = {torch.float8_e4m3fn: 2**-4, torch.float8_e5m2: 2**-3}


def test_flag_values():
    from pagedllm.config import KV_CACHE_DTYPES

    want = {
        "auto": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "int8": torch.int8,
        "fp8": torch.float8_e4m3fn,  # fp8: vLLM's alias
        "fp8_e4m3": torch.float8_e4m3fn,
        "fp8_e5m2": torch.float8_e5m2,
    }
    assert {name: resolve_kv_cache_dtype(name, torch.bfloat16) for name in KV_CACHE_DTYPES} == want
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_kv_cache_dtype("int4", torch.float32)


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_quantize_roundtrip(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 80, generator=g) * torch.logspace(-3, 2, 50)[:, None, None]
    x[7, 1] = 0.0
    xq, scale = quantize_kv(x, dtype)
    assert xq.dtype == dtype and scale.shape == (50, 3) and scale.dtype == torch.float32
    back = dequantize_kv(xq, scale, torch.float32)
    assert torch.all(back[7, 1] == 0)
    amax = x.abs().amax(-1, keepdim=True)
    torch.testing.assert_close(scale, (amax[..., 0] / QMAX[dtype]).clamp_min(1e-12), rtol=0, atol=0)
    err = (back - x).abs()
    if dtype == torch.int8:  # half a step, plus float rounding
        assert torch.all(err <= scale[..., None] * (0.5 + 1e-5))
    else:  # relative to each value, or the subnormal floor of the row's range
        floor = scale[..., None] * (2.0**-9 if dtype == torch.float8_e4m3fn else 2.0**-16)
        assert torch.all(err <= x.abs() * REL_STEP[dtype] * 1.001 + floor)


def test_spec_bytes_per_block():
    f32 = FullAttentionSpec(16, 3, 64, torch.float32)
    i8 = FullAttentionSpec(16, 3, 64, torch.int8)
    assert f32.page_size_bytes == 2 * 16 * 3 * 64 * 4
    assert i8.page_size_bytes == 2 * 16 * 3 * (64 + 4)  # values + a float32 scale per head
    assert [dt for _, dt in i8.kv_tensors(5)] == [torch.int8, torch.int8, torch.float32, torch.float32]
    assert i8.kv_tensors(5)[2][0] == (80, 3)


def quantized_pages(S, Hkv, D, dtype, owned, seed):
    """Random quantized K/V pages [S, Hkv, D] with their scales; slots outside `owned` get NaN
    scales (a read of them poisons the output)."""
    g = torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(2):
        xq, s = quantize_kv(torch.randn(S, Hkv, D, generator=g) * 3, dtype)
        caches.append((xq, s))
    (kq, ks), (vq, vs) = caches
    dead = torch.ones(S, dtype=torch.bool)
    dead[owned] = False
    ks[dead] = float("nan")
    vs[dead] = float("nan")
    return kq, vq, ks, vs


def decode_batch(H, Hkv, D, bs, seed):
    """A mixed batch (decodes around a chunk with a cached past) on a shuffled paged layout."""
    rng = np.random.default_rng(seed)
    q_lens = np.array([1, 1, 5, 1, 1])
    seq_lens = np.array([1, 37, 20, bs, 3 * bs + 1], dtype=np.int32)
    table, S = shuffled_block_table(seq_lens, bs, rng)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    pos = np.concatenate([np.arange(s) for s in seq_lens])
    req = np.repeat(np.arange(len(seq_lens)), seq_lens)
    owned = torch.from_numpy(table[req, pos // bs].astype(np.int64) * bs + pos % bs)
    owned = torch.cat([torch.arange(bs), owned])  # + the null block (the gathered path's padding)
    new = np.concatenate([np.arange(s - q, s) for s, q in zip(seq_lens, q_lens)])
    nreq = np.repeat(np.arange(len(q_lens)), q_lens)
    slots = torch.from_numpy(table[nreq, new // bs].astype(np.int64) * bs + new % bs)
    return qsl, seq_lens, table, S, slots, owned


def dense_reference(q, kc, vc, ks, vs, qsl, seq_lens, table, bs, scale):
    """float64 softmax attention per request over the dequantized pages (causal)."""
    K = dequantize_kv(kc, ks, torch.float64)
    V = dequantize_kv(vc, vs, torch.float64)
    H, Hkv = q.shape[1], kc.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for r in range(len(seq_lens)):
        s, a, b = int(seq_lens[r]), int(qsl[r]), int(qsl[r + 1])
        pos = np.arange(s)
        sl = torch.from_numpy(table[r, pos // bs].astype(np.int64) * bs + pos % bs)
        keys, vals = K[sl].repeat_interleave(H // Hkv, 1), V[sl].repeat_interleave(H // Hkv, 1)
        sc = torch.einsum("nhd,shd->hns", q[a:b].double(), keys) * scale
        qpos = torch.arange(s - (b - a), s)
        sc = sc.masked_fill(torch.arange(s)[None, :] > qpos[:, None], float("-inf"))
        out[a:b] = torch.einsum("hns,shd->nhd", sc.softmax(-1), vals)
    return out


@pytest.mark.usefixtures("cpu_isa")  # every build of the kernels this CPU runs
@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("H,Hkv,D,bs", [(9, 3, 64, 16), (8, 2, 128, 32), (6, 2, 80, 16)])
def test_torch_and_cpp_paths_on_quantized_pages(dtype, H, Hkv, D, bs):
    require_built(decode_kernel())
    qsl, seq_lens, table, S, slots, owned = decode_batch(H, Hkv, D, bs, seed=H + D)
    g = torch.Generator().manual_seed(3)
    T = int(qsl[-1])
    q, k, v = (
        torch.randn(T, H, D, generator=g),
        torch.randn(T, Hkv, D, generator=g),
        torch.randn(T, Hkv, D, generator=g),
    )
    outs, pages = [], None
    for by_pages in (False, True):
        kc, vc, ks, vs = quantized_pages(S, Hkv, D, dtype, owned, seed=1)
        meta = build_attention_metadata(qsl, seq_lens, table, bs, slots, decode_by_pages=by_pages)
        outs.append(cpu_attn.paged_attention(q, k, v, kc, vc, meta, D**-0.5, kv_scales=(ks, vs)))
        pages = (kc, vc, ks, vs)
    ref = dense_reference(q, *pages, qsl, seq_lens, table, bs, D**-0.5)
    assert torch.isfinite(outs[0]).all()
    torch.testing.assert_close(outs[0].double(), ref, atol=1e-5, rtol=1e-5)  # torch path
    torch.testing.assert_close(outs[1].double(), ref, atol=2e-5, rtol=2e-5)  # C++ decodes
    # bfloat16 queries: the kernel widens q, computes in float32 and rounds its output once
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    bf = cpu_attn.paged_attention(qb, kb, vb, *pages[:2], meta, D**-0.5, kv_scales=pages[2:])
    ref = dense_reference(qb.float(), *pages, qsl, seq_lens, table, bs, D**-0.5)
    dec = meta.decode_token_idx
    torch.testing.assert_close(bf[dec].double(), ref[dec].bfloat16().double(), atol=1e-2, rtol=1e-2)


def test_quantized_attention_stays_near_float():
    """int8 K/V: the attention output moves by about the quantization step, no more."""
    H, Hkv, D, bs = 9, 3, 64, 16
    qsl, seq_lens, table, S, slots, owned = decode_batch(H, Hkv, D, bs, seed=5)
    g = torch.Generator().manual_seed(4)
    T = int(qsl[-1])
    q, k, v = (
        torch.randn(T, H, D, generator=g),
        torch.randn(T, Hkv, D, generator=g),
        torch.randn(T, Hkv, D, generator=g),
    )
    kf, vf = torch.randn(S, Hkv, D, generator=g), torch.randn(S, Hkv, D, generator=g)
    meta = build_attention_metadata(qsl, seq_lens, table, bs, slots)
    ref = torch_sdpa.paged_attention(q, k, v, kf.clone(), vf.clone(), meta, D**-0.5)
    (kq, ks), (vq, vs) = quantize_kv(kf, torch.int8), quantize_kv(vf, torch.int8)
    out = torch_sdpa.paged_attention(q, k, v, kq, vq, meta, D**-0.5, kv_scales=(ks, vs))
    err = (out - ref).abs().max().item()
    assert 0 < err < 0.03, err


# ------------------------------------------------------------------------------ Triton
@pytest.mark.parametrize(
    "dtype,bs,H,Hkv,D,splits",
    [
        (torch.int8, 16, 6, 2, 64, 1),
        (torch.float8_e4m3fn, 32, 8, 1, 80, 1),
        (torch.float8_e5m2, 16, 4, 4, 64, 4),
        (torch.int8, 16, 8, 2, 128, 8),
    ],
)
def test_triton_matches_torch_path(dtype, bs, H, Hkv, D, splits):
    pytest.importorskip("triton")
    from attention_batch import Batch, mixed_reqs

    from pagedllm.attention.backends.triton_attn import paged_attention as tb

    reqs = mixed_reqs(bs) if splits == 1 else [(2 * bs + 5, 1), (3 * bs, 1), (bs - 1, 1)]
    b = Batch(reqs, bs, H, Hkv, D, seed=bs + D)
    T = int(b.query_start_loc[-1])
    past = torch.isfinite(b.k_cache[:, 0, 0])
    runs = []
    for path in ("torch", "triton"):
        (kq, ks), (vq, vs) = quantize_kv(b.k_cache.nan_to_num(), dtype), quantize_kv(b.v_cache.nan_to_num(), dtype)
        ks[~past], vs[~past] = float("nan"), float("nan")  # slots no request owns (yet)
        if path == "torch":
            meta = build_attention_metadata(b.query_start_loc, b.seq_lens, b.block_table, bs, b.slot_mapping[:T])
            out = torch_sdpa.paged_attention(b.q[:T], b.k[:T], b.v[:T], kq, vq, meta, b.scale, kv_scales=(ks, vs))
        else:
            out = tb.paged_attention(
                b.q, b.k, b.v, kq, vq, b.triton_meta(num_splits=splits), b.scale, kv_scales=(ks, vs)
            )
        runs.append((out, kq, vq, ks, vs))
    (ref, *ref_cache), (out, *cache) = runs
    written = b.slot_mapping[:T]
    for mine, theirs in zip(cache[2:], ref_cache[2:]):  # the new tokens' scales
        torch.testing.assert_close(mine[written], theirs[written], rtol=1e-6, atol=0)
    for mine, theirs in zip(cache[:2], ref_cache[:2]):  # the same stored values
        assert torch.equal(mine[written].view(torch.uint8), theirs[written].view(torch.uint8))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
