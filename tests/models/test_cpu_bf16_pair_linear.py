"""csrc/bf16_linear.cpp: the register-blocked bfloat16 linear over the pair layout, on every ISA
build this CPU runs, against a float64 matmul of the same bfloat16 values.

Tolerance: the kernel sums in float32 and rounds once to bfloat16, so an output is within half
a bfloat16 ulp (2^-9 relative) of its float32 sum, and that sum within K 2^-24 sum|x w| of the
exact one; we allow 2^-8 |ref| + 1e-5 sum_k |x_k w_k|.
"""

import pytest
import torch

from pagedllm.csrc import build


def ext_for(isa):
    ext = build.isa_extension(isa)
    if ext is None:
        pytest.fail(f"the {isa} build failed: {build.build_failures}")
    return ext


def reference(x, w, b):
    """float64 x w^T + b on the bfloat16 values -> (ref, sum |x w| per output)."""
    xd, wd = x.double(), w.double()
    ref = xd @ wd.T + (b.double() if b is not None else 0)
    return ref, xd.abs() @ wd.abs().T


@pytest.mark.parametrize("isa", build.runnable_isas())
@pytest.mark.parametrize("N,K", [(16, 32), (37, 33), (64, 2048), (200, 517), (3, 7), (130, 1030)])
@pytest.mark.parametrize("bias", [False, True])
def test_pair_linear_matches_float_reference(isa, N, K, bias):
    ext = ext_for(isa)
    g = torch.Generator().manual_seed(N * 1000 + K)
    w = torch.randn(N, K, generator=g).to(torch.bfloat16)
    b = torch.randn(N, generator=g).to(torch.bfloat16) if bias else None
    packed = ext.bf16_pair_pack(w)
    assert packed.shape == (N, (K + 1) // 2 * 2)
    # one tile (1-30 rows on AVX512-BF16: every tile shape) and 8-row tiles over K blocks (31 and
    # more; AVX2: one tile up to 4 rows)
    for M in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 24, 29, 30, 31, 33, 64, 203):
        x = torch.randn(M, K, generator=g).to(torch.bfloat16)
        y = ext.bf16_pair_linear(x, packed, b)
        assert y.shape == (M, N) and y.dtype == torch.bfloat16
        ref, mag = reference(x, w, b)
        err = (y.double() - ref).abs()
        tol = 2**-8 * ref.abs() + 1e-5 * mag + 1e-6
        assert (err <= tol).all(), f"M={M}: max error {(err - tol).max().item()} over the tolerance"


@pytest.mark.parametrize("isa", build.runnable_isas())
def test_pair_linear_rows_independent(isa):
    """A row's output does not depend on the rows beside it, nor on the thread count."""
    ext = ext_for(isa)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(100, 1500, generator=g).to(torch.bfloat16)
    packed = ext.bf16_pair_pack(w)
    x = torch.randn(64, 1500, generator=g).to(torch.bfloat16)
    whole = ext.bf16_pair_linear(x, packed, None)
    for m in (1, 5, 16, 17, 30, 31, 33):
        assert torch.equal(ext.bf16_pair_linear(x[:m], packed, None), whole[:m])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(ext.bf16_pair_linear(x, packed, None), whole)
    finally:
        torch.set_num_threads(threads)
