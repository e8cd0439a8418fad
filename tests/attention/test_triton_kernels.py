"""The Triton attention kernels on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1).

Compared with the torch backend (attention/backends/torch_sdpa/) and with a float64
per-request loop written here, on random inputs: batches mixing prefill chunks (with and
without cached past) and decodes, block sizes 16 and 32, GQA ratios 1, 3 and 8, head_dim 64,
80 and 128, contexts crossing block boundaries, shuffled physical block ids, and cache slots
that no request owns poisoned with NaN (a kernel that reads outside its blocks fails).
Tolerances: float32 attention atol = rtol = 1e-4 against either reference; split-K against
the one-pass kernel atol = rtol = 1e-5 (same tiles, only the combination order differs);
write-KV exact. float16 attention atol = rtol = 3e-3 against float32 math on the same inputs.
bfloat16 attention is not run: the 3.9 interpreter keeps bf16 as uint16 and its tl.dot
multiplies the raw integers (the bf16 *copy* of write-KV is exact and is tested).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton): GPU kernels untested")

from attention_batch import Batch, mixed_reqs  # noqa: E402

from pagedllm.attention.backends.torch_sdpa import paged_attention as torch_sdpa  # noqa: E402
from pagedllm.attention.backends.torch_sdpa.metadata import build_attention_metadata  # noqa: E402
from pagedllm.attention.backends.triton_attn import paged_attention as tb  # noqa: E402

ATOL = RTOL = 1e-4
SPLIT_TOL = 1e-5


def assert_cache_equal(a, b):
    torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)


# ------------------------------------------------------------------------------ write KV
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("as_blocks", [False, True])
def test_write_kv_exact(dtype, as_blocks):
    g = torch.Generator().manual_seed(1)
    bs, nb, Hkv, D, T = 16, 9, 3, 80, 37
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[[4, 17, 36]] = -1  # padding tokens: not written
    kv = torch.randn(T, 2 * Hkv * D + 5, generator=g).to(dtype)  # non-contiguous views
    k = kv[:, : Hkv * D].view(T, Hkv, D)
    v = kv[:, Hkv * D : 2 * Hkv * D].view(T, Hkv, D)
    kc = torch.randn(nb * bs, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(nb * bs, Hkv, D, generator=g).to(dtype)
    want_k, want_v = kc.clone(), vc.clone()
    keep = slots >= 0
    want_k[slots[keep]] = k[keep]
    want_v[slots[keep]] = v[keep]
    shape = (nb, bs, Hkv, D) if as_blocks else kc.shape
    tb.write_kv(k, v, kc.view(shape), vc.view(shape), slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


# ------------------------------------------------------------------------------ attention
CONFIGS = [  # (block_size, num_heads, num_kv_heads, head_dim)
    (16, 4, 4, 64),  # GQA 1 (MHA)
    (32, 6, 2, 64),  # GQA 3 (rows padded: BLOCK_Q * 3 < BLOCK_M)
    (16, 8, 1, 64),  # GQA 8
    (16, 6, 2, 80),  # head_dim not a power of two (padded to 128 with masks)
    (32, 8, 1, 128),
]


@pytest.mark.parametrize("bs,H,Hkv,D", CONFIGS)
def test_mixed_batch_matches_references(bs, H, Hkv, D):
    b = Batch(mixed_reqs(bs), bs, H, Hkv, D, seed=bs + H + D)
    ref_out, ref_kc, ref_vc = b.torch_reference()
    kc, vc = b.caches()
    out = tb.paged_attention(b.q, b.k, b.v, kc, vc, b.triton_meta(), b.scale)
    assert out.shape == b.q.shape and out.dtype == b.q.dtype
    assert_cache_equal(kc, ref_kc)
    assert_cache_equal(vc, ref_vc)
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out, b.loop_reference(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize(
    "block_m,block_q,block_n",
    [
        (16, 2, 16),  # key tiles smaller than a block
        (32, 5, 64),  # key tiles spanning several blocks; query rows padded (5 * 6 < 32)
        (64, 10, 32),
    ],
)
def test_tile_shapes(bs, block_m, block_q, block_n):
    H, Hkv, D = 6, 2, 64
    b = Batch(mixed_reqs(bs), bs, H, Hkv, D, seed=7)
    ref = b.loop_reference()
    kc, vc = b.caches()
    tb.write_kv(b.k, b.v, kc, vc, b.slot_mapping)
    m = b.triton_meta()
    out = tb.unified_attention(
        b.q,
        kc,
        vc,
        m.query_start_loc,
        m.seq_lens,
        m.block_table,
        bs,
        b.scale,
        block_m=block_m,
        block_q=block_q,
        block_n=block_n,
    )
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


def test_padding_tokens_are_skipped():
    """CUDA-graph style padding: extra tokens with slot -1 beyond query_start_loc[-1]."""
    bs, H, Hkv, D = 16, 6, 2, 64
    b = Batch(mixed_reqs(bs), bs, H, Hkv, D, seed=3, num_pad_tokens=5)
    T = int(b.query_start_loc[-1])
    ref_out, ref_kc, ref_vc = b.torch_reference()
    kc, vc = b.caches()
    for splits in (1, 4):
        out = torch.full_like(b.q, 123.0)
        tb.paged_attention(b.q, b.k, b.v, kc, vc, b.triton_meta(num_splits=splits), b.scale, out=out)
        assert_cache_equal(kc, ref_kc)
        assert_cache_equal(vc, ref_vc)
        torch.testing.assert_close(out[:T], ref_out, atol=ATOL, rtol=RTOL)
        assert torch.all(out[T:] == 123.0)  # padding rows are never written


def test_lower_level_matches_without_host_hints():
    """unified_attention computes max_query_len / max_seq_len itself when not given."""
    bs, H, Hkv, D = 16, 4, 4, 64
    b = Batch(mixed_reqs(bs), bs, H, Hkv, D, seed=11)
    kc, vc = b.caches()
    tb.write_kv(b.k, b.v, kc, vc, b.slot_mapping)
    out = tb.unified_attention(
        b.q,
        kc,
        vc,
        torch.from_numpy(b.query_start_loc),
        torch.from_numpy(b.seq_lens),
        torch.from_numpy(b.block_table),
        bs,
        b.scale,
    )
    torch.testing.assert_close(out, b.loop_reference(), atol=ATOL, rtol=RTOL)


# ------------------------------------------------------------------------------ split-K
def test_choose_num_splits():
    sms = 132
    assert tb.choose_num_splits(2, 2, 1, 4096, sms) == 64  # small batch: >= 64 keys per split
    assert tb.choose_num_splits(2, 2, 1, 1024, sms) == 16
    assert tb.choose_num_splits(1, 8, 1, 16384, sms) == 128  # 1024 programs: ~8 per SM
    assert tb.choose_num_splits(1, 8, 1, 4096, sms) == 64
    assert tb.choose_num_splits(8, 8, 1, 4096, sms) == 16
    assert tb.choose_num_splits(32, 8, 1, 4096, sms) == 4
    assert tb.choose_num_splits(2, 2, 1, 100, sms) == 1  # short context
    assert tb.choose_num_splits(2, 2, 7, 4096, sms) == 1  # not all-decode
    assert tb.choose_num_splits(128, 8, 1, 4096, sms) == 1  # ~8 programs per SM already
    n = tb.choose_num_splits(20, 2, 1, 4096, sms)
    assert 1 < n <= tb.SPLIT_MAX and n & (n - 1) == 0


@pytest.mark.parametrize("bs,H,Hkv,D", [(16, 6, 2, 64), (32, 8, 1, 80)])
def test_split_k_decode_long_context(bs, H, Hkv, D):
    reqs = [(700, 1), (37, 1), (1000, 1)]  # all-decode, small batch, long contexts
    b = Batch(reqs, bs, H, Hkv, D, seed=5)
    meta = b.triton_meta()
    assert meta.all_decode
    chosen = tb.choose_num_splits(meta.num_reqs, Hkv, meta.max_query_len, meta.max_seq_len)
    assert chosen > 1  # the automatic path splits
    kc, vc = b.caches()
    auto = tb.paged_attention(b.q, b.k, b.v, kc, vc, meta, b.scale)
    one = tb.unified_attention(
        b.q,
        kc,
        vc,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_table,
        bs,
        b.scale,
        max_query_len=1,
        max_seq_len=meta.max_seq_len,
        num_splits=1,
    )
    torch.testing.assert_close(auto, one, atol=SPLIT_TOL, rtol=SPLIT_TOL)
    torch.testing.assert_close(auto, b.loop_reference(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("num_splits", [3, 8])  # not a power of two; more splits than tiles
def test_split_k_mixed_batch(num_splits):
    """Split-K is general (any query lengths); empty splits and all-masked rows weigh 0."""
    bs, H, Hkv, D = 16, 6, 2, 64
    b = Batch(mixed_reqs(bs), bs, H, Hkv, D, seed=9)
    kc, vc = b.caches()
    tb.write_kv(b.k, b.v, kc, vc, b.slot_mapping)
    m = b.triton_meta()
    args = (b.q, kc, vc, m.query_start_loc, m.seq_lens, m.block_table, bs, b.scale)
    one = tb.unified_attention(*args, num_splits=1)
    split = tb.unified_attention(*args, num_splits=num_splits)
    torch.testing.assert_close(split, one, atol=SPLIT_TOL, rtol=SPLIT_TOL)
    torch.testing.assert_close(split, b.loop_reference(), atol=ATOL, rtol=RTOL)


# ------------------------------------------------------------------------------ float16
@pytest.mark.parametrize("num_splits", [1, 2])
def test_float16(num_splits):
    bs, H, Hkv, D = 16, 6, 2, 64
    b = Batch(mixed_reqs(bs), bs, H, Hkv, D, seed=13, dtype=torch.float16)
    kc, vc = b.caches()
    out = tb.paged_attention(b.q, b.k, b.v, kc, vc, b.triton_meta(num_splits=num_splits), b.scale)
    assert out.dtype == torch.float16
    ref = b.loop_reference()  # float64 math on the same float16 inputs
    torch.testing.assert_close(out.float(), ref, atol=3e-3, rtol=3e-3)


# ------------------------------------------------------------------------------ sliding window
def test_sliding_window_matches_torch_backend():
    """A window of 10 keys over prefill chunks, chunks with past and long decodes, one pass and
    split-K: the same as the torch backend's windowed metadata; the blocks wholly before each
    request's first window (a sliding KV cache group frees them) point at a NaN block that
    must never be read."""
    bs, H, Hkv, D, W = 8, 4, 2, 32, 10
    reqs = [(0, 2 * bs + 1), (5 * bs + 3, 1), (3 * bs + 2, bs + 5), (bs + 5, 1), (2 * bs, 2)]
    b = Batch(reqs, bs, H, Hkv, D, seed=21)
    spare = sorted(set(range(1, b.num_blocks)) - set(b.block_table.reshape(-1).tolist()))[0]
    for r, (c, _) in enumerate(reqs):  # the blocks freed behind the window (tokens <= c - W)
        b.block_table[r, : max((c - W + 1) // bs, 0)] = spare
    assert (b.block_table == spare).sum() >= 4 and torch.isnan(b.k_cache[spare * bs]).all()
    kc, vc = b.caches()
    meta = build_attention_metadata(b.query_start_loc, b.seq_lens, b.block_table, bs, b.slot_mapping, sliding_window=W)
    ref = torch_sdpa.paged_attention(b.q, b.k, b.v, kc, vc, meta, b.scale)
    for num_splits in (1, 3):
        kc, vc = b.caches()
        out = tb.paged_attention(b.q, b.k, b.v, kc, vc, b.triton_meta(num_splits=num_splits), b.scale, sliding_window=W)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
    full = tb.paged_attention(b.q, b.k, b.v, *b.caches(), b.triton_meta(), b.scale)
    assert torch.isnan(full).any()  # without the window the freed blocks are read
