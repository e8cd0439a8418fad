"""Linear layers over oneDNN-prepacked weights, for the CPU.

F.linear on the CPU hands the plain [out, in] weight to MKL's sgemm at every call. oneDNN's
linear over a weight reordered once, at load time, into its own blocked layout is 1.5-2x
faster at every batch an engine sees, from one decode token to a 2048-token prefill chunk
(BENCHMARKS.md), with the same float32 arithmetic: only the order of the sums differs
(~1e-6 relative). At 1-3 rows (a decode step of 1-3 requests) the step is bound by reading the
weights, and a plain row-streaming kernel (models/cpu_ops.py `linear_small`) reads them faster
than oneDNN does (23 vs 17 GB/s at one row); so the plain weight is kept beside the packed copy
(twice the weight memory, except a tied LM head, which shares the embedding's).
In bfloat16 oneDNN runs its bf16 kernels (AVX512-BF16 here: 1.5-2.8x its float32 rate at
every size, accumulating in float32), and the row-streaming kernel reads half the bytes.
`PAGEDLLM_CPU_PACKED_LINEAR=0` keeps plain F.linear (to compare).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from pagedllm import envs

logger = logging.getLogger(__name__)


def packed_linear_supported(dtype: torch.dtype) -> bool:
    if not envs.PAGEDLLM_CPU_PACKED_LINEAR:
        return False
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's layout (and the plain W for 1-3 rows)."""

    SMALL_ROWS = 3   # up to this many rows, the row-streaming kernel on the plain weight

    def __init__(self, linear: nn.Linear, small_ops=None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # The batch-size hint only picks the blocking; any number of rows works with it.
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 128)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = linear.bias
        self.small_ops = small_ops if linear.weight.dtype in (torch.float32, torch.bfloat16) else None
        self.weight = linear.weight if self.small_ops is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.small_ops is not None and 0 < x.shape[0] <= self.SMALL_ROWS:
            return self.small_ops.linear_small(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module) -> int:
    """Swap every plain nn.Linear of a loaded model for a PackedLinear (a tied LM head gets its
    own packed copy; the embedding keeps the shared weight). Returns how many were swapped.
    Subclasses with a forward of their own (tensor-parallel row layers) are left as they are."""
    from pagedllm.models.parallel_layers import ColumnParallelLinear
    dtype = next(model.parameters()).dtype
    if not packed_linear_supported(dtype):
        return 0
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children()
             if type(child) in (nn.Linear, ColumnParallelLinear)]
    from pagedllm.models.cpu_ops import cpu_ops
    small_ops = cpu_ops()
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child, small_ops))
    logger.debug("packed %d linear layers for oneDNN", len(swaps))
    return len(swaps)
