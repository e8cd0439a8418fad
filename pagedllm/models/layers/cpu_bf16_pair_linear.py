"""bfloat16 linear layers on a CPU where oneDNN has no bfloat16 kernels (no AVX512-BF16: every
AVX2-only CPU), over the C++ kernels.

There torch's F.linear runs a generic bf16 path at ~11 GFLOP/s a core whatever the row count,
and CPUPackedLinearMethod (oneDNN) does not apply. This method holds the weight twice, as that
one does, where the memory holds it (weight_copies.py; else `one_copy`: the pair layout alone):
the plain [out, in] weight for the row-streaming `linear_small` at 1-SMALL_ROWS rows (it reads
the weights fastest: a decode step of a few requests), and the weight in the pair
layout of csrc/bf16_linear.cpp (`bf16_pair_pack`, pairs of K per 16 columns) for the
register-blocked `bf16_pair_linear` above (3.4-4.3x F.linear at 16-64 rows on AVX2, and faster
at prefill chunks: docs/history/benchmarks.md). Both sum in float32 and round to bfloat16 once.
A tied LM head shares the embedding's plain weight (ParallelLMHead), so only its pair copy is
new. `PAGEDLLM_CPU_PACKED_LINEAR=0` turns this off with oneDNN's packing (plain F.linear).
"""

from __future__ import annotations

import torch

from pagedllm import envs
from pagedllm.models.layers.cpu_packed_linear import CPUPackedLinearMethod, packed_linear_supported
from pagedllm.models.layers.linear_method import UnquantizedLinearMethod


def pair_linear_supported(dtype: torch.dtype, ops) -> bool:
    """bfloat16, oneDNN without bf16 kernels (else CPUPackedLinearMethod), the kernels built."""
    return (
        envs.PAGEDLLM_CPU_PACKED_LINEAR
        and dtype == torch.bfloat16
        and not packed_linear_supported(dtype)
        and ops is not None
        and hasattr(ops, "bf16_pair_linear")
    )


class CPUBf16PairLinearMethod(UnquantizedLinearMethod):
    """y = x W^T + b: linear_small on the plain W (`layer.weight`) at 1-SMALL_ROWS rows, else
    bf16_pair_linear on W's pair layout (`layer.pair_weight` [out, in rounded up to even])."""

    SMALL_ROWS = CPUPackedLinearMethod.SMALL_ROWS  # against bf16_pair_linear, not oneDNN: on every ISA

    def __init__(self, ops) -> None:
        self.ops = ops
        self.small_rows = self.SMALL_ROWS
        self.one_copy = False  # only the pair layout, for every row count (weight_copies.py)

    def second_copy_bytes(self, layer) -> int:
        """Bytes the plain weight holds beside the pair layout (weight_copies.py): none in a tied
        LM head, whose plain weight is the embedding's table."""
        return 0 if getattr(layer, "tied_to", ()) else layer.weight.numel() * layer.weight.element_size()

    def process_weights_after_loading(self, layer):
        layer.register_buffer("pair_weight", self.ops.bf16_pair_pack(layer.weight.detach()), persistent=False)
        if self.one_copy:
            self.small_rows = 0
            layer.weight = None  # a tied LM head's: the embedding keeps its own

    def apply(self, layer, x, bias=None):
        if 0 < x.shape[0] <= self.small_rows:
            return self.ops.linear_small(x, layer.weight, bias)
        return self.ops.bf16_pair_linear(x, layer.pair_weight, bias)
