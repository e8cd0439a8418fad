"""C++ paged-attention kernels for decode and prefill on the CPU, compiled once on first use.

The torch path gathers every decode request's whole context out of the paged cache into a
padded tensor each layer (a copy as large as the context) before attending. This kernel reads
K and V straight from the pages through the block table, once: for each (request, KV head)
the G query heads that share that KV head are scored together, then a softmax, then the
weighted sum of V. A bfloat16 or float16 cache is read the same way, each key / value row
widened to float32 as it is loaded (q, scores, softmax and the sums all in float32; the output
rounded once): half the bytes of a float32 cache. Its vector path (head_dim 64, 128, 256) is
one source for the AVX-512 and AVX2 builds (csrc/cpu_vec.h); other head dims take a portable
loop. The C++ is csrc/attention.cpp, built with
the other CPU kernels into one extension (csrc/build.py); if it cannot be built,
`decode_kernel()` is None and the caller keeps the torch path.

Prefill chunks (csrc/prefill_attention.cpp's paged_prefill) go the same way, flash-attention
style: where the torch path gathers a chunk's past out of the pages, runs one SDPA call per
chunk and copies its [1, H, q, D] output into the step's [T, H, D], the kernel takes every
chunk of the step in one call, tiles of query tokens x the G heads of a KV head against tiles
of keys read through the block table, an online softmax in float32, each chunk's rows written
in place into the step's output (a bfloat16 cache's QK^T and PV on bfloat16 pairs with
AVX512-BF16's vdpbf16ps, exact products summed in float32; PV's weights rounded to bfloat16
first). float32, bfloat16 and float16 caches (an int8 /
fp8 cache keeps the torch path); head_dim a multiple of 16.
"""

from __future__ import annotations

import torch

from pagedllm.csrc.build import cpu_extension


def decode_kernel():
    """The compiled kernel (csrc/attention.cpp's paged_decode), or None."""
    ext = cpu_extension()
    return ext.paged_decode if ext is not None else None


DECODE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PREFILL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def prefill_kernel(dtype: torch.dtype, head_dim: int):
    """csrc/prefill_attention.cpp's paged_prefill where it takes this cache dtype and head_dim
    and is built, else None (the caller keeps the torch path)."""
    if dtype not in PREFILL_DTYPES or head_dim % 16:
        return None
    ext = cpu_extension()
    return ext.paged_prefill if ext is not None else None


def cpu_decode_supported(dtype: torch.dtype) -> bool:
    """Whether decode attention can read the pages of a CPU KV cache of this dtype directly."""
    return dtype in DECODE_DTYPES and decode_kernel() is not None
