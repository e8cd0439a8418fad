"""Paged attention in Triton: the launches of the GPU backend (kernels in kernels.py, step
metadata in metadata.py).

Same cache layout and the same call as the torch backend:

    paged_attention(q, k, v, k_cache, v_cache, meta, scale) -> out [num_tokens, num_heads, head_dim]

with ``meta`` a :class:`TritonAttentionMetadata` (index tensors on the device, built once per
step and shared by every layer). The lower-level entry points take the tensors directly:
``write_kv`` (reshape_and_cache) and ``unified_attention`` (varlen, mixed prefill chunks and
decodes, optional split-K). Every launch's grid depends only on num_tokens, num_reqs and
num_kv_heads, never on a device value, so no call synchronises with the device when
``max_query_len`` / ``max_seq_len`` are given as Python ints (they only steer the tile shapes
and the split-K choice; correctness does not depend on them). Each entry point has a
``*_launches`` twin that describes its launches (kernels/triton_launch.py) for the AOT tools.

Without a GPU the kernels run on CPU tensors under ``TRITON_INTERPRET=1`` (the tests do that).
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedllm.attention.backends.triton_attn.kernels import (
    reduce_splits_kernel,
    reshape_and_cache_kernel,
    unified_attention_kernel,
)
from pagedllm.attention.backends.triton_attn.metadata import TritonAttentionMetadata
from pagedllm.attention.kv_quant import QMAX, is_quantized
from pagedllm.kernels.triton_launch import KernelLaunch, launch_options, next_pow2

# split-K (flash-decoding) heuristics, for all-decode batches only. A decode program streams
# its keys with a few KB in flight: the HBM needs several resident programs per SM to be kept
# busy, so small batches cut each (request, KV head) range into splits until the grid has
# about SPLIT_CTAS_PER_SM programs per SM. Measured on an H100 (bench attention --cuda-graph
# --num-splits ..., 32/8 heads, head_dim 64, bf16): ~8 programs per SM was best at batch 1 and 8
# from 4k to 16k keys (batch 8, 16k: 90 % of the copy rate against 72 % with 4 per SM).
SPLIT_MIN_KEYS = 64  # each split covers at least this many keys of the longest context
SPLIT_MAX = 128  # at most this many splits (a power of two: few kernel variants)
SPLIT_CTAS_PER_SM = 8
DEFAULT_NUM_SMS = 132  # without a CUDA device (the interpreter): an H100's count

_num_sms_cache: dict = {}


def num_sms(device: torch.device) -> int:
    """The device's streaming multiprocessors (DEFAULT_NUM_SMS off CUDA): split-K's budget."""
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _num_sms_cache:
        _num_sms_cache[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _num_sms_cache[idx]


# ---------------------------------------------------------------------------------- write K/V
def _kv_quant(kc: torch.Tensor, kv_scales: Optional[tuple]) -> tuple[int, float, torch.Tensor, torch.Tensor]:
    """(KV_QUANT, QMAX, K_scale, V_scale) of the kernels' arguments for a cache: 0 for a cache
    of the model's dtype (the scale pointers then unused), 1 int8, 2 fp8 e4m3, 3 fp8 e5m2
    (attention/kv_quant.py)."""
    if kv_scales is None:
        return 0, 1.0, kc, kc
    ks, vs = kv_scales
    assert is_quantized(kc.dtype), "kv_scales go with an int8 / fp8 cache"
    assert ks.dtype == vs.dtype == torch.float32 and ks.is_contiguous() and vs.is_contiguous()
    code = {torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}[kc.dtype]
    return code, QMAX[kc.dtype], ks, vs


def write_kv_launch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: Optional[tuple] = None,
) -> Optional[KernelLaunch]:
    """reshape_and_cache of k/v [num_tokens, num_kv_heads, head_dim]; None when there are no
    tokens."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return None
    kc = k_cache.view(-1, num_kv_heads, head_dim)
    vc = v_cache.view(-1, num_kv_heads, head_dim)
    assert v.shape == k.shape and slot_mapping.shape[0] >= num_tokens
    quant, qmax, ks, vs = _kv_quant(kc, kv_scales)
    return KernelLaunch(
        reshape_and_cache_kernel,
        (num_tokens,),
        (k, v, kc, vc, slot_mapping, ks, vs, *k.stride(), *v.stride(), *kc.stride(), *vc.stride()),
        dict(
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_H=next_pow2(num_kv_heads),
            BLOCK_D=next_pow2(head_dim),
            KV_QUANT=quant,
            QMAX=qmax,
        ),
        launch_options(4 if num_kv_heads * head_dim >= 1024 else 1),
    )


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: Optional[tuple] = None,
) -> None:
    """reshape_and_cache: k/v [num_tokens, num_kv_heads, head_dim] into the caches
    [num_slots, num_kv_heads, head_dim] (or a [num_blocks, block_size, ...] view of them) at
    slot_mapping [num_tokens]; tokens with a negative slot (padding) are skipped. kv_scales:
    (K_scale, V_scale) [num_slots, num_kv_heads] float32 of an int8 / fp8 cache."""
    launch = write_kv_launch(k, v, k_cache, v_cache, slot_mapping, kv_scales)
    if launch is not None:
        launch.launch()


reshape_and_cache = write_kv


# ---------------------------------------------------------------------------------- attention
def choose_num_splits(
    num_reqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, num_sms: int = DEFAULT_NUM_SMS
) -> int:
    """Split-K for all-decode batches whose (request, KV head) programs are fewer than
    SPLIT_CTAS_PER_SM per SM and whose contexts are long enough to share out: the largest power
    of two in [1, SPLIT_MAX] that keeps the grid within that many programs per SM and each
    split at SPLIT_MIN_KEYS keys or more. For a CUDA graph max_seq_len is max_model_len: the
    kernel shares each request's actual keys among the splits, so shorter contexts leave the
    last splits empty (they weigh 0 in the reduction)."""
    if max_query_len > 1 or max_seq_len < 2 * SPLIT_MIN_KEYS:
        return 1
    programs = max(1, num_reqs * num_kv_heads)
    want = min(SPLIT_MAX, SPLIT_CTAS_PER_SM * num_sms // programs, max_seq_len // SPLIT_MIN_KEYS)
    splits = 1
    while splits * 2 <= want:
        splits *= 2
    return splits


def _tile_shapes(
    num_queries_per_kv: int,
    max_query_len: int,
    head_pad: int,
    exact_fp32: bool,
    block_m: Optional[int],
    block_q: Optional[int],
    block_n: Optional[int],
    sliding: bool = False,
):
    """(BLOCK_M, BLOCK_Q, BLOCK_N, num_warps). exact_fp32: float32 dots in "ieee" precision
    run as FMAs on CUDA cores with every operand in registers, so they take narrower KV tiles
    and more warps; without that, sm_80 / sm_90 builds spill
    (tools/aot_attention.py shows registers and spills per variant). A sliding window's
    second mask spills float32 tiles too: 32 rows for prefill, 8 warps."""
    rows_min = max(16, next_pow2(num_queries_per_kv))
    if block_m is None:
        # decode: one query token per program, its query heads as rows; prefill: bigger tiles
        big = 32 if exact_fp32 and sliding else 64
        block_m = rows_min if max_query_len * num_queries_per_kv <= rows_min else max(big, rows_min)
    if block_q is None:
        block_q = 1 if max_query_len <= 1 else block_m // num_queries_per_kv
    assert block_m >= 16 and block_m & (block_m - 1) == 0, "BLOCK_M: a power of two >= 16"
    assert 1 <= block_q and block_q * num_queries_per_kv <= block_m, "BLOCK_Q * (H / Hkv) must fit BLOCK_M"
    if block_n is None:
        block_n = 16 if exact_fp32 or head_pad > 128 else 32
    assert block_n >= 16 and block_n & (block_n - 1) == 0, "BLOCK_N: a power of two >= 16"
    if exact_fp32:
        num_warps = 8 if block_m >= 64 or sliding else 4
    else:
        num_warps = 4 if block_m * head_pad >= 64 * 64 else 2
    return block_m, block_q, block_n, num_warps


def attention_launches(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    scale: float,
    out: torch.Tensor,
    max_query_len: Optional[int] = None,
    max_seq_len: Optional[int] = None,
    num_splits: Optional[int] = None,
    block_m: Optional[int] = None,
    block_q: Optional[int] = None,
    block_n: Optional[int] = None,
    fp32_precision: str = "ieee",
    kv_scales: Optional[tuple] = None,
    sliding_window: Optional[int] = None,
) -> list[KernelLaunch]:
    """The launches of ``unified_attention`` (its arguments; ``out`` given): the attention
    kernel, then with split-K the reduction; split-K partials are allocated here. kv_scales:
    (K_scale, V_scale) [num_slots, num_kv_heads] float32 of an int8 / fp8 cache.
    sliding_window W: each query attends to its last W keys only (None: all)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[-2]
    kc = k_cache.view(-1, num_kv_heads, head_dim)
    vc = v_cache.view(-1, num_kv_heads, head_dim)
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    quant, _, k_scale, v_scale = _kv_quant(kc, kv_scales)
    assert vc.dtype == kc.dtype and (quant or kc.dtype == q.dtype), "q and the caches must share a dtype"
    assert block_table.dtype == torch.int32 and block_table.stride(-1) == 1
    assert query_start_loc.dtype == torch.int32 and seq_lens.dtype == torch.int32
    nq = num_heads // num_kv_heads
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return []
    if max_query_len is None:  # device sync: pass them when they are known on the host
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    precision = fp32_precision if q.dtype == torch.float32 else None  # None: the target's default
    head_pad = next_pow2(max(16, head_dim))
    block_m, block_q, block_n, num_warps = _tile_shapes(
        nq, max_query_len, head_pad, precision == "ieee", block_m, block_q, block_n, bool(sliding_window)
    )
    if num_splits is None:
        num_splits = choose_num_splits(num_reqs, num_kv_heads, max_query_len, max_seq_len, num_sms(q.device))
    if num_splits > 1:
        part_acc = torch.empty((num_tokens, num_heads, num_splits, head_pad), dtype=torch.float32, device=q.device)
        part_m = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused
    launches = [
        KernelLaunch(
            unified_attention_kernel,
            (num_tokens // block_q + num_reqs, num_kv_heads, num_splits),
            (
                q,
                kc,
                vc,
                out,
                part_acc,
                part_m,
                part_l,
                block_table,
                query_start_loc,
                seq_lens,
                k_scale,
                v_scale,
                float(scale),
                num_reqs,
                *q.stride(),
                *kc.stride(),
                *vc.stride(),
                *out.stride(),
                block_table.stride(0),
            ),
            dict(
                NUM_QUERIES_PER_KV=nq,
                NUM_HEADS=num_heads,
                HEAD_DIM=head_dim,
                HEAD_PAD=head_pad,
                BLOCK_SIZE=int(block_size),
                BLOCK_Q=block_q,
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                NUM_SPLITS=num_splits,
                DOT_PRECISION=precision,
                KV_QUANT=quant,
                SLIDING_WINDOW=int(sliding_window or 0),
            ),
            launch_options(num_warps, num_stages=2),
        )
    ]
    if num_splits > 1:
        launches.append(
            KernelLaunch(
                reduce_splits_kernel,
                (num_tokens, num_heads),
                (out, part_acc, part_m, part_l, query_start_loc, num_reqs, *out.stride()),
                dict(
                    NUM_HEADS=num_heads,
                    HEAD_DIM=head_dim,
                    HEAD_PAD=head_pad,
                    NUM_SPLITS=num_splits,
                    BLOCK_S=next_pow2(num_splits),
                ),
                launch_options(max(1, min(8, next_pow2(num_splits) * head_pad // 1024))),
            )
        )
    return launches


def unified_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    scale: float,
    out: Optional[torch.Tensor] = None,
    **kwargs,
) -> torch.Tensor:
    """Varlen paged attention over the cache (the step's K/V must already be written).

    q [num_tokens, num_heads, head_dim]; caches [num_slots, num_kv_heads, head_dim];
    query_start_loc [num_reqs + 1] int32, seq_lens [num_reqs] int32, block_table
    [num_reqs, max_blocks] int32, all on q's device. Request r's new tokens are
    q[qsl[r]:qsl[r+1]] at positions seq_lens[r] - q_len .. seq_lens[r] - 1: causal among
    themselves, full over the cached past. Tokens past qsl[num_reqs] (padding) are left
    unwritten in ``out``. Keyword arguments (see attention_launches): max_query_len and
    max_seq_len (host ints; computed with a device sync when missing), num_splits (None
    chooses: split-K only for all-decode batches with long contexts; 1 forces the one-pass
    kernel, n > 1 forces n splits), block_m / block_q / block_n (tile shapes), fp32_precision
    (tl.dot precision for float32 inputs: "ieee" exact, "tf32" faster on a GPU), sliding_window
    (each query attends to its last W keys only; keys before the window are never read).
    """
    if out is None:
        out = torch.empty_like(q)
    for launch in attention_launches(
        q, k_cache, v_cache, query_start_loc, seq_lens, block_table, block_size, scale, out, **kwargs
    ):
        launch.launch()
    return out


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: TritonAttentionMetadata,
    scale: float,
    out: Optional[torch.Tensor] = None,
    kv_scales: Optional[tuple] = None,
    sliding_window: Optional[int] = None,
) -> torch.Tensor:
    """The torch backend's call: write this step's K/V at meta.slot_mapping, then attend (to the
    last sliding_window keys only, when given).
    q [T, H, D], k/v [T, Hkv, D], caches [S, Hkv, D] -> out [T, H, D]; kv_scales: (K_scale,
    V_scale) [S, Hkv] float32 of an int8 / fp8 cache."""
    if out is None:
        out = torch.empty_like(q)
    for launch in paged_attention_launches(q, k, v, k_cache, v_cache, meta, scale, out, kv_scales, sliding_window):
        launch.launch()
    return out


def paged_attention_launches(
    q,
    k,
    v,
    k_cache,
    v_cache,
    meta: TritonAttentionMetadata,
    scale: float,
    out: torch.Tensor,
    kv_scales: Optional[tuple] = None,
    sliding_window: Optional[int] = None,
) -> list[KernelLaunch]:
    """The launches of one layer's ``paged_attention``, in order."""
    write = write_kv_launch(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
    return ([write] if write is not None else []) + attention_launches(
        q,
        k_cache,
        v_cache,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_table,
        meta.block_size,
        scale,
        out,
        max_query_len=meta.max_query_len,
        max_seq_len=meta.max_seq_len,
        num_splits=meta.num_splits,
        kv_scales=kv_scales,
        sliding_window=sliding_window,
    )
