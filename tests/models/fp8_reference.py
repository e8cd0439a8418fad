"""Block-FP8 dequantization written out block by block, as DeepSeek-V3's checkpoint format
defines it (each [bn, bk] block of e4m3 values times its `weight_scale_inv`): the reference the
FP8 tests compare pagedllm's kernels and loader with (independent of models/layers/quantization/fp8.py)."""

import torch


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """q [N, K] float8_e4m3fn, scale_inv [ceil(N / bn), ceil(K / bk)] -> [N, K] float64."""
    bn, bk = block
    out = q.to(torch.float64)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            out[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] *= float(scale_inv[i, j])
    return out
