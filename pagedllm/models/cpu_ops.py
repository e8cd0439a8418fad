"""Fused CPU ops for the layers' element-wise work: RMSNorm, SiLU-and-multiply, RoPE; and the
row-streaming matrix-vector product for 1-8 rows (`linear_small`). float32 and bfloat16.

In eager torch each of these is 5-10 passes over the activations (pow, mean, add, rsqrt,
mul, mul; silu, mul; index, mul, neg, cat, ...), each a kernel launch from Python; here each is
one pass over the rows, in parallel. The arithmetic is transformers' (RMSNorm in float32,
rotate-half RoPE); only the order of a row's sum differs. In bfloat16 each op computes in
float32 and rounds to bfloat16 where torch's bfloat16 ops round (so the result is torch's up to
the order of a sum); `linear_small` accumulates in float32 and rounds once. The C++ is
csrc/fused_ops.cpp (built by csrc/build.py). Other dtypes, or a machine where the extension
cannot be built, keep the layers' torch code (models/layers/).
"""

from __future__ import annotations

import torch

from pagedllm.csrc.build import cpu_extension

FUSED_DTYPES = (torch.float32, torch.bfloat16)


def cpu_ops():
    """The compiled extension (csrc/fused_ops.cpp's rms_norm, silu_and_mul, rotary_embedding_,
    linear_small among its functions), or None."""
    return cpu_extension()


def fused_cpu_ops():
    """The fused ops for a layer being built now, or None (the layer's torch code): they apply
    where the model is built on the CPU in float32 or bfloat16 (the loader sets torch's default
    device and dtype while it builds). Decided once, when the layer is built."""
    if torch.get_default_device().type != "cpu" or torch.get_default_dtype() not in FUSED_DTYPES:
        return None
    return cpu_ops()
