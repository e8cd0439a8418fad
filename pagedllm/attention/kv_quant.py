"""A quantized KV cache (`--kv-cache-dtype int8 | fp8_e4m3 | fp8_e5m2`, vLLM's flag).

Each token's K (and V) row of each KV head is stored as int8 / fp8 with its own float32 scale
(per token per head): scale = max|row| / QMAX, stored = row / scale (int8: rounded half away
from zero, so every writer rounds alike). A token's scale depends on that row alone, so a
write never touches another token's entries (no block-wide requantisation) and the readers
fold the scale into what they already compute: score = (q . k_q) * k_scale and the softmax
weight p * v_scale. Cache tensors of a layer: (K, V, K_scale, V_scale), K/V [S, Hkv, D] of the
quantized dtype and the scales [S, Hkv] float32 (S = num_blocks * block_size slots).
"""

from __future__ import annotations

import torch

from pagedllm.config import KV_CACHE_DTYPES, check_kv_cache_dtype

# The largest magnitude each quantized type holds (fp8 e4m3: 448; e5m2: 57344).
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
SCALE_DTYPE = torch.float32
_TINY = 1e-12  # the scale of an all-zero row: any positive value decodes it back to zeros


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for the flag's value (config.KV_CACHE_DTYPES; auto: the model's dtype)."""
    torch_name = KV_CACHE_DTYPES[check_kv_cache_dtype(name)]
    return getattr(torch, torch_name) if torch_name is not None else model_dtype


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def check_kv_cache_cast(
    cache_dtype: torch.dtype, model_dtype: torch.dtype, device_type: str, why_not: str = ""
) -> None:
    """A float cache of another dtype than the model's (--kv-cache-dtype bfloat16 under float32)
    is read by the CPU kernels and the torch path only, and holds no latent or recurrent state
    (why_not: the model's layers that refuse it, if any); else a ValueError naming the field."""
    if is_quantized(cache_dtype) or cache_dtype == model_dtype:
        return
    if cache_dtype != torch.bfloat16 or model_dtype != torch.float32 or device_type != "cpu" or why_not:
        raise ValueError(
            f"kv_cache_dtype bfloat16 takes a bfloat16 model, or a float32 model on the CPU without MLA or "
            f"recurrent layers; got a {model_dtype} model on {device_type}{' with ' + why_not if why_not else ''}"
        )


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, Hkv, D] -> (x_q [T, Hkv, D] of dtype, scale [T, Hkv] float32), x ~ x_q * scale."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / QMAX[dtype]).clamp_min(_TINY)  # [T, Hkv]
    y = xf / scale[..., None]
    if dtype == torch.int8:  # half away from zero: Triton's writer computes the same
        y = torch.where(y >= 0, torch.floor(y + 0.5), -torch.floor(0.5 - y)).clamp(-127, 127)
    return y.to(dtype), scale


def dequantize_kv(x_q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x_q [..., Hkv, D] with scale [..., Hkv] -> x [..., Hkv, D] of dtype."""
    return (x_q.float() * scale[..., None]).to(dtype)


def write_kv_quantized(
    k: torch.Tensor, v: torch.Tensor, caches: tuple[torch.Tensor, ...], slot_mapping: torch.Tensor
) -> None:
    """reshape_and_cache into a quantized cache (K, V, K_scale, V_scale) at slot_mapping [T]."""
    k_cache, v_cache, k_scale, v_scale = caches
    for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        x_q, s = quantize_kv(x, cache.dtype)
        # index_copy_ has no fp8 kernel on the CPU: copy the bytes
        cache.view(torch.uint8).index_copy_(0, slot_mapping, x_q.view(torch.uint8))
        scales.index_copy_(0, slot_mapping, s)


def read_kv(
    caches: tuple[torch.Tensor, ...], slots: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V at slots (any shape) -> [*slots.shape, Hkv, D] of dtype, dequantized if need be."""
    if len(caches) == 2:  # a bfloat16 cache under float32 queries: widened, exact
        return caches[0][slots].to(dtype), caches[1][slots].to(dtype)
    k_cache, v_cache, k_scale, v_scale = caches
    return (dequantize_kv(k_cache[slots], k_scale[slots], dtype), dequantize_kv(v_cache[slots], v_scale[slots], dtype))
