"""A C++ paged-attention kernel for decode on the CPU, compiled once on first use.

The torch path gathers every decode request's whole context out of the paged cache into a
padded tensor each layer (a copy as large as the context) before attending. This kernel reads
K and V straight from the pages through the block table, once: for each (request, KV head)
the G query heads that share that KV head are scored together, then a softmax, then the
weighted sum of V. A bfloat16 cache is read the same way, each key / value row widened to
float32 as it is loaded (q, scores, softmax and the sums all in float32; the output rounded to
bfloat16 once): half the bytes of a float32 cache. The C++ is csrc/attention.cpp, built with
the other CPU kernels into one extension (csrc/build.py); if it cannot be built,
`decode_kernel()` is None and the caller keeps the torch path.
"""
from __future__ import annotations

import torch

from pagedllm.csrc.build import cpu_extension


def decode_kernel():
    """The compiled kernel (csrc/attention.cpp's paged_decode), or None."""
    ext = cpu_extension()
    return ext.paged_decode if ext is not None else None


DECODE_DTYPES = (torch.float32, torch.bfloat16)


def cpu_decode_supported(dtype: torch.dtype) -> bool:
    """Whether decode attention can read the pages of a CPU KV cache of this dtype directly."""
    return dtype in DECODE_DTYPES and decode_kernel() is not None
