"""Triton kernels of the GPU attention backend (launched by paged_attention.py).

Cache layout (the same as the torch backend's): per layer two tensors
[num_blocks * block_size, num_kv_heads, head_dim]; slot = block_id * block_size + offset.
The kernels address it only through its strides, so a [num_blocks, block_size, ...] view of
the same memory works as well.

Kernels
- ``reshape_and_cache_kernel``: one program per new token writes its K and V
  [num_kv_heads, head_dim] at ``slot_mapping[token]``; a negative slot (padding) is skipped.
  KV_QUANT (an int8 / fp8 cache, attention/kv_quant.py): each head's row is stored divided by
  its scale max|row| / QMAX (int8 rounded half away from zero), the scale beside it
  ([num_slots, num_kv_heads] float32); the attention kernel multiplies a key's scores by its
  K scale and a value's softmax weights by its V scale.
- ``unified_attention_kernel``: varlen paged attention for a batch that mixes prefill chunks
  (with or without cached past) and decodes. One program per (query block, KV head[, split]).
  A query block is BLOCK_Q consecutive new tokens of one request times the NUM_QUERIES_PER_KV
  query heads that share the KV head, flattened into BLOCK_M = BLOCK_Q * NUM_QUERIES_PER_KV
  (padded to a power of two >= 16) rows, so a K/V tile read from the cache serves every query
  head of its group (GQA) and both matmuls are ``tl.dot``s. KV tiles of BLOCK_N keys are read
  straight from the paged cache through the block table (one block-table lookup per key, so
  BLOCK_N is independent of block_size); online softmax in float32, base 2.
  With SLIDING_WINDOW = W > 0 a query at p attends keys (p - W, p] only: the tiles wholly before
  the first query's window are skipped, and keys before it are never read (a sliding-window
  KV cache group may have freed their blocks: backends/torch_sdpa/metadata.py).
  With NUM_SPLITS > 1 (split-K / flash-decoding) the third grid axis cuts each program's KV
  range into NUM_SPLITS pieces of whole tiles; each writes its unnormalised partial
  (max, sum, acc), and ``reduce_splits_kernel`` combines them.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def reshape_and_cache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,  # [num_slots, num_kv_heads] float32 (unused without KV_QUANT)
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcs,
    stride_vch,
    stride_vcd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_QUANT: tl.constexpr = 0,
    QMAX: tl.constexpr = 1.0,  # 0: none, 1: int8, 2: fp8 e4m3, 3: e5m2
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(
        k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask, other=0.0
    )
    v = tl.load(
        v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask, other=0.0
    )
    if KV_QUANT:
        k = _quantize_rows(k, k_scale_ptr + slot * NUM_KV_HEADS + offs_h, offs_h < NUM_KV_HEADS, KV_QUANT, QMAX)
        v = _quantize_rows(v, v_scale_ptr + slot * NUM_KV_HEADS + offs_h, offs_h < NUM_KV_HEADS, KV_QUANT, QMAX)
    tl.store(
        k_cache_ptr + slot * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd,
        k.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_cache_ptr + slot * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd,
        v.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _quantize_rows(x, scale_ptrs, row_mask, KV_QUANT: tl.constexpr, QMAX: tl.constexpr):
    """x [BLOCK_H, BLOCK_D] -> x / scale per row (int8: rounded half away from zero), its
    scales max|row| / QMAX stored at scale_ptrs (kv_quant.quantize_kv's arithmetic)."""
    xf = x.to(tl.float32)
    # IEEE divisions (div_rn), as the host and torch round: a GPU's default float32 division is
    # approximate (div.full) and moves a value on a rounding boundary to the next code.
    amax = tl.max(tl.abs(xf), axis=1)
    scale = tl.maximum(tl.math.div_rn(amax, tl.zeros_like(amax) + QMAX), 1e-12)
    tl.store(scale_ptrs, scale, mask=row_mask)
    y = tl.math.div_rn(xf, scale[:, None])
    if KV_QUANT == 1:
        y = tl.where(y >= 0, tl.floor(y + 0.5), -tl.floor(0.5 - y))
        y = tl.minimum(tl.maximum(y, -127.0), 127.0)
    else:
        # Round to the fp8 mantissa (3 bits e4m3, 2 bits e5m2) to nearest even in float32 bits
        # first, so the cast is exact: torch's rounding everywhere (the 3.9 interpreter's own
        # cast gets the exponent wrong when rounding carries into it).
        DROP: tl.constexpr = 20 if KV_QUANT == 2 else 21  # float32 mantissa bits dropped
        KEEP: tl.constexpr = 0xFFF00000 if KV_QUANT == 2 else 0xFFE00000
        u = y.to(tl.uint32, bitcast=True)
        u = (u + ((1 << (DROP - 1)) - 1) + ((u >> DROP) & 1)) & KEEP
        # Below the smallest normal (2^-6 e4m3, 2^-14 e5m2) the step is fixed (2^-9, 2^-16):
        # adding and taking away 1.5 * 2^(23 - step bits) rounds to it, to nearest even.
        MIN_NORMAL: tl.constexpr = 2.0**-6 if KV_QUANT == 2 else 2.0**-14
        MAGIC: tl.constexpr = 1.5 * 2.0**14 if KV_QUANT == 2 else 1.5 * 2.0**7
        y = tl.where(tl.abs(y) < MIN_NORMAL, (y + MAGIC) - MAGIC, u.to(tl.float32, bitcast=True))
    return y


@triton.jit
def _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q: tl.constexpr):
    """The request whose query blocks contain global query block ``q_block``.

    Request i owns the global ids [qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1): at least
    cdiv(q_len, BLOCK_Q) of them, strictly increasing in i, so a binary search finds it and the
    grid size num_tokens // BLOCK_Q + num_reqs depends on no device value."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _query_block(query_start_loc_ptr, seq_lens_ptr, q_block, num_reqs, BLOCK_Q: tl.constexpr):
    """Global query block q_block -> (its request, the request's first token, its number of new
    tokens, the block's index inside them, the tokens already cached before this step). A
    program whose q_block_local * BLOCK_Q >= q_len is past its request's last block."""
    req = _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + req)
    context_len = tl.load(seq_lens_ptr + req) - q_len
    return req, q_start, q_len, q_block_local, context_len


@triton.jit
def unified_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    # split-K partials (unused when NUM_SPLITS == 1)
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    k_scale_ptr,
    v_scale_ptr,  # [num_slots, num_kv_heads] float32 (unused without KV_QUANT)
    scale,
    num_reqs,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcs,
    stride_vch,
    stride_vcd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_bt,
    NUM_QUERIES_PER_KV: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr = 0,
    SLIDING_WINDOW: tl.constexpr = 0,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    req, q_start, q_len, q_block_local, context_len = _query_block(
        query_start_loc_ptr, seq_lens_ptr, q_block, num_reqs, BLOCK_Q
    )
    if q_block_local * BLOCK_Q >= q_len:  # past this request's last query block
        return

    # Rows: (query token, query head of this KV head's group) flattened.
    offs_m = tl.arange(0, BLOCK_M)
    q_pos = q_block_local * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV  # index inside the chunk
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
    row_valid = (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_pos < q_len)
    token = (q_start + q_pos).to(tl.int64)
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d < HEAD_DIM

    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_valid[:, None] & d_mask[None, :],
        other=0.0,
    )
    # Position of each query in its sequence: it attends keys 0 ..= q_abs.
    q_abs = context_len + q_pos

    # Keys this query block needs at all, as whole tiles, then this split's share of them.
    kv_len = context_len + tl.minimum((q_block_local + 1) * BLOCK_Q, q_len)
    num_tiles = tl.cdiv(kv_len, BLOCK_N)
    first_key = 0  # the first key any row of the block attends (its first query's window)
    if SLIDING_WINDOW > 0:
        first_key = tl.maximum(context_len + q_block_local * BLOCK_Q - SLIDING_WINDOW + 1, 0)
    first_tile = first_key // BLOCK_N
    if NUM_SPLITS == 1:
        tile_lo = first_tile
        tile_hi = num_tiles
    else:
        tiles_per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
        tile_lo = first_tile + split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    qk_scale = scale * 1.4426950408889634  # exp(x) = exp2(x * log2(e))
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    kv_off = kv_head.to(tl.int64)

    for tile in range(tile_lo, tile_hi):
        key_pos = tile * BLOCK_N + offs_n
        key_valid = (key_pos < kv_len) & (key_pos >= first_key)
        phys = tl.load(bt_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        slot = phys * BLOCK_SIZE + key_pos % BLOCK_SIZE
        kv_mask = key_valid[None, :] & d_mask[:, None]
        k = tl.load(
            k_cache_ptr + slot[None, :] * stride_kcs + kv_off * stride_kch + offs_d[:, None] * stride_kcd,
            mask=kv_mask,
            other=0.0,
        )  # [HEAD_PAD, BLOCK_N]
        v = tl.load(
            v_cache_ptr + slot[:, None] * stride_vcs + kv_off * stride_vch + offs_d[None, :] * stride_vcd,
            mask=key_valid[:, None] & d_mask[None, :],
            other=0.0,
        )  # [BLOCK_N, HEAD_PAD]

        if KV_QUANT:  # int8 / fp8 -> q's dtype is exact; the scales fold into s and p
            k = k.to(q.dtype)
            v = v.to(q.dtype)
            sc_off = slot * (NUM_HEADS // NUM_QUERIES_PER_KV) + kv_off  # scales [slots, num_kv_heads]
            k_sc = tl.load(k_scale_ptr + sc_off, mask=key_valid, other=0.0)
            v_sc = tl.load(v_scale_ptr + sc_off, mask=key_valid, other=0.0)
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * (k_sc * qk_scale)[None, :]
        else:
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        attend = key_valid[None, :] & (key_pos[None, :] <= q_abs[:, None]) & row_valid[:, None]
        if SLIDING_WINDOW > 0:
            attend = attend & (key_pos[None, :] > q_abs[:, None] - SLIDING_WINDOW)
        s = tl.where(attend, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with nothing to attend so far keeps m = -inf; subtract 0 instead to avoid nan.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if KV_QUANT:
            acc += tl.dot((p * v_sc[None, :]).to(v.dtype), v, input_precision=DOT_PRECISION)
        else:
            acc += tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & d_mask[None, :],
        )
    else:
        # partials: m/l [num_tokens, NUM_HEADS, NUM_SPLITS], acc [num_tokens, NUM_HEADS, NUM_SPLITS, HEAD_PAD]
        row = (token * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(part_m_ptr + row, m_i, mask=row_valid)
        tl.store(part_l_ptr + row, l_i, mask=row_valid)
        tl.store(part_acc_ptr + row[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=row_valid[:, None])


@triton.jit
def reduce_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    query_start_loc_ptr,
    num_reqs,
    stride_ot,
    stride_oh,
    stride_od,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """out[token, head] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, M = max_s m_s."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + num_reqs):  # padding token: never attended
        return
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, HEAD_PAD)
    row = (token * NUM_HEADS + head) * NUM_SPLITS + offs_s
    m = tl.load(part_m_ptr + row, mask=s_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + row, mask=s_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.math.exp2(m - m_max))  # empty splits weigh 0
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_PAD + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    num = tl.sum(acc * w[:, None], axis=0)
    den = tl.sum(l * w, axis=0)
    out = num / tl.where(den == 0.0, 1.0, den)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )
