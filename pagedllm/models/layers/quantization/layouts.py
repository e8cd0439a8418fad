"""The quantized weight layouts and their torch reference (the kernels are csrc/quant_ops.cpp).

A weight W [N, K] is integers q, scales s and mins m [N, K/G] (groups of G input features of
one output row): w = q * s + m (no mins: w = q * s).
- int8: q [N, K] int8 (-128..127).
- int4: q [N, K/2] uint8; each run of 32 features is 16 bytes, byte i holding feature i in its
  low nibble and feature i + 16 in its high nibble (q in 0..15): GGUF's Q4_0/Q4_1 block layout.
"""

from __future__ import annotations

import torch


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] integers 0..15 (K a multiple of 32) -> [N, K/2] uint8 in the int4 layout."""
    n, k = q.shape
    q = q.to(torch.uint8).view(n, k // 32, 2, 16)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 -> q [N, K] uint8 (0..15)."""
    n, half = packed.shape
    p = packed.view(n, half // 16, 1, 16)
    return torch.cat([p & 15, p >> 4], dim=2).reshape(n, 2 * half)


def dequantize_reference(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] of a quantized one (q * s, + m where there are mins)."""
    q = unpack_int4(qweight) if qweight.dtype == torch.uint8 else qweight
    n, k = q.shape
    g = k // scales.shape[1]
    w = q.float().view(n, -1, g) * scales[:, :, None]
    if mins.numel():
        w = w + mins[:, :, None]
    return w.view(n, k)


def quantize_int8(w: torch.Tensor, group_size: int):
    """Symmetric: float w [N, K] -> q int8 [N, K] (-127..127), scales [N, K/G] = amax / 127."""
    n, k = w.shape
    g = w.float().view(n, k // group_size, group_size)
    scales = g.abs().amax(dim=2) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(g / scales[:, :, None]).clamp(-127, 127).to(torch.int8)
    return q.view(n, k), scales.contiguous()


def quantize_int8_offset(w: torch.Tensor, group_size: int):
    """float w [N, K] -> q int8 [N, K] (-128..127), scales = (max - min) / 255, mins = min + 128 s
    [N, K/G] (w = q s + m): all 256 codes over the group's own range (a group whose values sit
    off zero keeps every step, not half of [-amax, amax]). 255 = 15 x 17, so a group of 16
    evenly spaced levels (a Q4_1 / Q4_K block: the default model's weights) is held exactly."""
    n, k = w.shape
    g = w.float().view(n, k // group_size, group_size)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scales = (hi - lo) / 255
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((g - lo[:, :, None]) / scales[:, :, None]).clamp(0, 255) - 128
    return q.to(torch.int8).view(n, k), scales.contiguous(), (lo + 128 * scales).contiguous()


def quantize_int4(w: torch.Tensor, group_size: int):
    """Asymmetric: float w [N, K] -> packed q [N, K/2], scales = (max - min) / 15, mins = min
    [N, K/G] (the zero point as a float: w = q s + m)."""
    n, k = w.shape
    g = w.float().view(n, k // group_size, group_size)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scales = (hi - lo) / 15
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((g - lo[:, :, None]) / scales[:, :, None]).clamp(0, 15)
    return pack_int4(q.view(n, k)), scales.contiguous(), lo.contiguous()


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers (its weights as held)."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        try:
            key = t.data_ptr()
        except RuntimeError:  # an opaque oneDNN-packed weight (cpu_packed_linear): no pointer, same bytes
            key = id(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total
