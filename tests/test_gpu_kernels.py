"""Every Triton kernel of the GPU path compiled and run on a real GPU, in the dtypes the engine
runs them in (bfloat16 first; float16, float32; fp8 where it applies), against references
that do not use the kernels: float64 loops over the same rounded inputs (attention_batch.py),
torch's own fp8 / int8 rounding, and the torch paths on the host. Skipped, with the reason,
where torch sees no CUDA device: the CPU runs the same kernels under Triton's interpreter in
float32 / float16 (test_triton_kernels.py, test_kv_quant.py, test_fp8_linear.py,
test_lora_ops.py), where bfloat16 dots cannot run (the interpreter multiplies bf16's raw bits).

Tolerances: bfloat16 outputs atol = rtol = 2e-2 (inputs are exact in bf16; the kernels round
the softmax weights and the output to bf16, ~3 significant digits), float16 3e-3, float32 1e-4.
K/V written: exact (the same bits), or for a quantized cache the same rounding as torch's cast.
"""

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

from attention_batch import Batch, mixed_reqs  # noqa: E402

DEV = "cuda"
TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-4}


def _attend(b: Batch, **meta):
    """The Triton backend's paged_attention on the GPU -> (out, k_cache, v_cache) on the host."""
    from pagedllm.attention.backends.triton_attn import paged_attention as tb

    d = b.on(DEV)
    kc, vc = d.k_cache.clone(), d.v_cache.clone()
    out = tb.paged_attention(d.q, d.k, d.v, kc, vc, d.triton_meta(**meta), b.scale)
    return out.cpu(), kc.cpu(), vc.cpu()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bs,H,Hkv,D", [(16, 32, 8, 64), (16, 16, 4, 128), (32, 12, 4, 80)])
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_mixed_batch_attention(dtype, bs, H, Hkv, D, num_splits):
    """Prefill chunks with and without past, decodes, block boundaries, padding tokens, NaN in
    every slot no request owns; the new K/V written bit for bit."""
    b = Batch(mixed_reqs(bs), bs, H, Hkv, D, seed=bs + D, dtype=dtype, num_pad_tokens=3)
    T = int(b.query_start_loc[-1])
    out, kc, vc = _attend(b, num_splits=num_splits)
    ref = b.loop_reference()
    tol = TOL[dtype]
    torch.testing.assert_close(out[:T].float(), ref, atol=tol, rtol=tol)
    slots = b.slot_mapping[:T]
    assert torch.equal(kc[slots], b.k[:T]) and torch.equal(vc[slots], b.v[:T])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_k_decode_long_contexts(dtype):
    """All-decode batches with contexts of thousands of keys: split-K as the engine chooses it,
    and forced, against the float64 loop."""
    bs = 16
    reqs = [(3000, 1), (17, 1), (1500, 1), (4095, 1)]
    b = Batch(reqs, bs, 32, 8, 64, seed=7, dtype=dtype)
    ref = b.loop_reference()
    for splits in (None, 8, 64):
        out, _, _ = _attend(b, num_splits=splits)
        torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sliding_window(dtype):
    """Window of 10 keys over chunks and decodes; the blocks before each request's first window
    point at a NaN block that must never be read."""
    from pagedllm.attention.backends.torch_sdpa import paged_attention as torch_sdpa
    from pagedllm.attention.backends.torch_sdpa.metadata import build_attention_metadata
    from pagedllm.attention.backends.triton_attn import paged_attention as tb

    bs, H, Hkv, D, W = 8, 8, 2, 64, 10
    reqs = [(0, 2 * bs + 1), (5 * bs + 3, 1), (3 * bs + 2, bs + 5), (bs + 5, 1), (2 * bs, 2)]
    b = Batch(reqs, bs, H, Hkv, D, seed=21, dtype=dtype)
    spare = sorted(set(range(1, b.num_blocks)) - set(b.block_table.reshape(-1).tolist()))[0]
    for r, (c, _) in enumerate(reqs):
        b.block_table[r, : max((c - W + 1) // bs, 0)] = spare
    f = b.on("cpu", torch.float32)  # the torch backend's windowed path in float32, same values
    meta = build_attention_metadata(b.query_start_loc, b.seq_lens, b.block_table, bs, b.slot_mapping, sliding_window=W)
    ref = torch_sdpa.paged_attention(f.q, f.k, f.v, f.k_cache.clone(), f.v_cache.clone(), meta, b.scale)
    for splits in (1, 3):
        d = b.on(DEV)
        out = tb.paged_attention(
            d.q,
            d.k,
            d.v,
            d.k_cache.clone(),
            d.v_cache.clone(),
            d.triton_meta(num_splits=splits),
            b.scale,
            sliding_window=W,
        )
        torch.testing.assert_close(out.cpu().float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def _quantize_rows(x: torch.Tensor, dtype: torch.dtype):
    """Per (token, head) row: scale = max|row| / the type's largest value, the row / scale cast
    with torch's rounding (int8: half away from zero) -> (stored, scale)."""
    qmax = 127.0 if dtype == torch.int8 else torch.finfo(dtype).max
    scale = (x.float().abs().amax(-1) / qmax).clamp_min(1e-12)
    y = x.float() / scale[..., None]
    if dtype == torch.int8:
        y = (torch.sign(y) * torch.floor(y.abs() + 0.5)).clamp(-127, 127)
    return y.to(dtype), scale


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype,num_splits", [(torch.bfloat16, 1), (torch.bfloat16, 4), (torch.float32, None)])
def test_quantized_kv_cache(cache_dtype, dtype, num_splits):
    """--kv-cache-dtype int8 / fp8: the new tokens' K/V stored as torch rounds them, with their
    scales; attention equals the float64 loop over the dequantized cache."""
    from pagedllm.attention.backends.triton_attn import paged_attention as tb

    bs, H, Hkv, D = 16, 16, 4, 64
    reqs = mixed_reqs(bs) if num_splits == 1 else [(2 * bs + 5, 1), (300, 1), (bs - 1, 1)]
    b = Batch(reqs, bs, H, Hkv, D, seed=3, dtype=dtype)
    T = int(b.query_start_loc[-1])
    past = torch.isfinite(b.k_cache[:, 0, 0].float())
    (kq, ks), (vq, vs) = (_quantize_rows(c.nan_to_num(), cache_dtype) for c in (b.k_cache, b.v_cache))
    ks[~past], vs[~past] = float("nan"), float("nan")  # slots no request owns (yet): poisoned
    d = b.on(DEV)
    kq_d, vq_d, ks_d, vs_d = (t.to(DEV) for t in (kq, vq, ks, vs))
    out = tb.paged_attention(
        d.q, d.k, d.v, kq_d, vq_d, d.triton_meta(num_splits=num_splits), b.scale, kv_scales=(ks_d, vs_d)
    )
    slots = b.slot_mapping[:T]
    for new, stored, scale in ((b.k[:T], kq_d, ks_d), (b.v[:T], vq_d, vs_d)):
        want, want_scale = _quantize_rows(new, cache_dtype)
        torch.testing.assert_close(scale.cpu()[slots], want_scale, rtol=1e-6, atol=0)
        same = stored.cpu()[slots].view(torch.uint8) == want.view(torch.uint8)
        assert same.all(), f"{(~same).sum()} stored values differ from torch's rounding"
    # The reference: the cache as stored (the new tokens included), dequantized, in float64.
    deq = b.on("cpu", torch.float64)
    deq.k_cache = kq_d.cpu().double() * ks_d.cpu().double()[..., None]
    deq.v_cache = vq_d.cpu().double() * vs_d.cpu().double()[..., None]
    deq.k, deq.v = deq.k_cache[slots], deq.v_cache[slots]
    ref = deq.loop_reference()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.cpu()[:T].float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "M,N,K,block", [(1, 200, 300, (128, 128)), (37, 96, 160, (64, 32)), (256, 2048, 1024, (128, 128))]
)
def test_block_fp8_linear(dtype, M, N, K, block):
    """Fp8LinearMethod's GEMM: block-FP8 weights (DeepSeek-V3's checkpoints) times activations of
    the model's dtype, against float64 math on the dequantized weight."""
    from pagedllm.models.layers.quantization.fp8 import dequantize_block_fp8
    from pagedllm.models.layers.fp8_linear import block_fp8_linear, quantize_block_fp8

    g = torch.Generator().manual_seed(M + N)
    w, s = quantize_block_fp8(torch.randn(N, K, generator=g) * 0.05, block)
    x = torch.randn(M, K, generator=g).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype)
    ref = x.double() @ dequantize_block_fp8(w, s, block, torch.float64).T + bias.double()
    out = block_fp8_linear(x.to(DEV), w.to(DEV), s.to(DEV), block, bias.to(DEV)).cpu()
    assert out.dtype == dtype and out.shape == (M, N)
    # the product is accumulated in float32; the output rounded to the dtype
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol * max(1.0, ref.abs().max().item()), rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T", [5, 300])
def test_lora_shrink_expand(dtype, T):
    """The LoRA Triton ops (shrink, then expand into y) for tokens of three adapter slots and the
    base model, against the torch path on the host in float64; base rows untouched."""
    from pagedllm.lora.punica import LoRAMapping, add_lora_torch
    from pagedllm.lora.triton_ops import add_lora_triton

    g = torch.Generator().manual_seed(T)
    L, R, K, N = 3, 24, 300, 70
    slots = torch.randint(-1, L, (T,), generator=g)
    m = LoRAMapping(False)
    m.set(slots.numpy().astype(np.int32), "cpu")
    x = torch.randn(T, K, generator=g).to(dtype)
    a = (torch.randn(L, R, K, generator=g) * 0.3).to(dtype)
    b = (torch.randn(N, L * R, generator=g) * 0.3).to(dtype)
    y0 = torch.randn(T, N, generator=g).to(dtype)
    want = y0.double()
    add_lora_torch(want, x.double(), a.double(), b.double(), m)
    got = y0.to(DEV)
    add_lora_triton(got, x.to(DEV), a.to(DEV), b.to(DEV).view(N, L, R).permute(1, 0, 2), slots.to(DEV))
    got = got.cpu()
    tol = TOL[dtype] if dtype != torch.bfloat16 else 5e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    base = slots < 0
    assert torch.equal(got[base], y0[base])
