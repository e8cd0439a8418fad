"""Linear layers over oneDNN-prepacked weights, for the CPU.

F.linear on the CPU hands the plain [out, in] weight to MKL's sgemm at every call. oneDNN's
linear over a weight reordered once, after loading, into its own blocked layout is 1.5-2x
faster at every batch an engine sees, from one decode token to a 2048-token prefill chunk
(BENCHMARKS.md), with the same float32 arithmetic: only the order of the sums differs
(~1e-6 relative). At 1-8 rows (a decode step of a few requests, a verification step) the step is bound by reading the
weights, and a plain row-streaming kernel (models/cpu_ops.py `linear_small`) reads them faster
than oneDNN does (23 vs 17 GB/s at one row); so the plain weight is kept beside the packed copy
(twice the weight memory, except a tied LM head, which shares the embedding's) where the memory
holds it (weight_copies.py: else `one_copy`, oneDNN's weight alone for every row count).
On a CPU without AVX-512 (AVX2's 16 registers), oneDNN's float32 kernels run at ~0.85x MKL's
sgemm from ~512 rows on (a prefill chunk; both read the weight from memory once a call at that
size): there a layer's F.linear is faster (prefill 1.07-1.11x end to end, BENCHMARKS.md), while
at decode sizes and in the LM head (49,152+ columns) the packed copy stays faster at every size.
In bfloat16 oneDNN runs its bf16 kernels (AVX512-BF16 here: 1.5-2.8x its float32 rate at
every size, accumulating in float32), and the row-streaming kernel reads half the bytes.
Where the kernels' AVX512-BF16 build runs, a bfloat16 weight's few-row kernel is instead
bf16_pair_linear over the weight in pairs of K (csrc/bf16_linear.cpp), up to
SMALL_ROWS_BF16_PAIRS rows: it reads the weights at the machine's rate where oneDNN's bf16
linear reaches ~70 % of it (1.0-1.5x oneDNN at 1-32 rows, the 1B shape; 2.5x linear_small at
8). The pair copy then takes the plain weight's place (again two copies); in an LM head tied to
the embedding too, the embedding then looking its rows up in the pair copy (`bf16_pair_rows`):
the 1B shape's head in the engine 3.4x linear_small at 8 rows, 1.3x oneDNN at 16.
`PAGEDLLM_CPU_PACKED_LINEAR=0` keeps plain F.linear (to compare).
"""

from __future__ import annotations

import torch

from pagedllm import envs
from pagedllm.csrc.build import selected_isa
from pagedllm.models.layers.linear_method import UnquantizedLinearMethod


def packed_linear_supported(dtype: torch.dtype) -> bool:
    if not envs.PAGEDLLM_CPU_PACKED_LINEAR:
        return False
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


def bf16_pairs_native(ops) -> bool:
    """Whether bf16_pair_linear runs its AVX512-BF16 tiles here (the kernels' avx512 build)."""
    return ops is not None and hasattr(ops, "bf16_pair_linear") and selected_isa() == "avx512"


def cpu_has_avx512() -> bool:
    """Whether torch's CPU kernels (and MKL / oneDNN with them) run at AVX-512 here."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


class CPUPackedLinearMethod(UnquantizedLinearMethod):
    """y = x W^T + b with W held in oneDNN's layout (`layer.packed_weight`), and for 1-`small_rows`
    rows when the kernels (small_ops, models/cpu_ops.py) are built the plain W for the
    row-streaming kernel (and, without AVX-512, for LARGE_ROWS and more in float32, but not in the
    LM head: then `eager_from_rows`), or a bfloat16 W in pairs (`layer.pair_weight`, `pairs`)."""

    # From this many rows, float32 on a CPU without AVX-512 (cpu_has_avx512), a layer other
    # than the LM head: F.linear on the plain weight (MKL's sgemm).
    LARGE_ROWS = 512

    # Up to this many rows, the row-streaming kernel on the plain weight: a decode step of a few
    # requests, or a speculative verification of k + 1 tokens (at k = 4, batch 1), which then
    # reads the weights once, as a one-token step does. A float32 weight where torch runs
    # oneDNN's AVX-512 code: SMALL_ROWS_F32_AVX512, its packed linear ahead from 4 rows and ~2x
    # at 8 (`bench linear`, the 1B shape; SmolLM2's 6- / 8-request decode 1.08-1.24x / 1.49x,
    # Zen 5). In bfloat16 linear_small stays ahead at 4-8 rows on SmolLM2's shape (1.04-1.16x).
    # bfloat16 in the kernels' AVX512-BF16 build: bf16_pair_linear up to SMALL_ROWS_BF16_PAIRS
    # rows (the 1B shape, 2 threads: 1.4-1.5x oneDNN at 16-30 rows, where one tile reads the
    # weights once; 1.06-1.09x at 31-32, over K blocks; 1.00x at 48, 0.93x at 64).
    SMALL_ROWS = 8
    SMALL_ROWS_F32_AVX512 = 3
    SMALL_ROWS_BF16_PAIRS = 32

    def __init__(self, small_ops=None, lm_head: bool = False) -> None:
        self.small_ops = small_ops
        self.lm_head = lm_head
        self.small_rows = self.SMALL_ROWS
        self.pairs = False  # the few-row kernel: bf16_pair_linear on pair_weight, not linear_small
        self.one_copy = False  # only oneDNN's packed weight, for every row count (weight_copies.py)

    def second_copy_bytes(self, layer) -> int:
        """Bytes the few-row kernel's copy adds beside the packed weight (weight_copies.py): none
        in a tied LM head, whose plain or pair copy stands for the embedding's table."""
        if self.small_ops is None or getattr(layer, "tied_to", ()):
            return 0
        return layer.weight.numel() * layer.weight.element_size()

    def process_weights_after_loading(self, layer):
        large_by_sgemm = (
            not self.one_copy
            and self.small_ops is not None
            and not self.lm_head
            and layer.weight.dtype == torch.float32
            and not cpu_has_avx512()
        )
        self.eager_from_rows = self.LARGE_ROWS if large_by_sgemm else None
        if self.one_copy:
            self.small_rows = 0  # oneDNN at every row count
        elif layer.weight.dtype == torch.float32 and cpu_has_avx512():
            self.small_rows = self.SMALL_ROWS_F32_AVX512
        self.pairs = not self.one_copy and layer.weight.dtype == torch.bfloat16 and bf16_pairs_native(self.small_ops)
        if self.pairs:
            self.small_rows = self.SMALL_ROWS_BF16_PAIRS
            pairs = self.small_ops.bf16_pair_pack(layer.weight.detach())  # [N, K rounded up to even]
            layer.register_buffer("pair_weight", pairs, persistent=False)
        # The batch-size hint only picks the blocking; any number of rows works with it.
        packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), 128)
        layer.register_buffer("packed_weight", packed, persistent=False)
        tied = getattr(layer, "tied_to", ())
        if self.pairs and tied:  # the embedding reads its rows from the pair copy
            K, ops = layer.weight.shape[1], self.small_ops
            tied[0].hold_rows(lambda ids: ops.bf16_pair_rows(layer.pair_weight, ids, K))
        if self.small_ops is None or self.pairs or self.one_copy:
            layer.weight = None  # nothing reads the plain weight: don't hold it twice (a tied head's: the embedding's)

    def apply(self, layer, x, bias=None):
        if self.small_ops is not None and 0 < x.shape[0] <= self.small_rows:
            if self.pairs:
                return self.small_ops.bf16_pair_linear(x, layer.pair_weight, bias)
            return self.small_ops.linear_small(x, layer.weight, bias)
        if self.eager_from_rows is not None and x.shape[0] >= self.eager_from_rows:
            return torch.nn.functional.linear(x, layer.weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, bias, "none", [], "")
