"""The block-FP8 GEMM of Fp8LinearMethod (models/layers/fp8_linear.py): on a GPU, or under
Triton's interpreter on the CPU, against float64 math on the weight dequantized block by block
(tests/models/fp8_reference.py; odd M / N / K, partial blocks, blocks of [128, 128] and
[64, 32], float32, float16 and bfloat16 activations: bf16 only on a GPU, the 3.9 interpreter
multiplies bf16's raw bits), the method on a layer (load float, quantize, apply), and the kernel
compiled for sm_90 (no spills) in a subprocess without the interpreter."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere (as conftest.py)

import pytest  # noqa: E402
from fp8_reference import dequantize_blocks  # noqa: E402
from kernel_utils import run_aot_script  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install triton): GPU kernels untested")

from pagedllm.models.layers.fp8_linear import (
    Fp8LinearMethod,
    block_fp8_linear,  # noqa: E402
    quantize_block_fp8,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    "M,N,K,block,dtype",
    [
        (1, 200, 300, (128, 128), torch.float32),  # a decode row; partial blocks on both axes
        (37, 96, 160, (64, 32), torch.float32),
        (19, 130, 256, (128, 128), torch.float16),
        (19, 130, 256, (128, 128), torch.bfloat16),
        (1, 200, 300, (128, 128), torch.bfloat16),
    ],
)
def test_block_fp8_matmul_matches_dequantized_reference(M, N, K, block, dtype):
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("no CUDA device (the CPU interpreter cannot run bf16 tl.dot)")
    g = torch.Generator().manual_seed(M + N)
    w, s = quantize_block_fp8(torch.randn(N, K, generator=g) * 0.05, block)
    x = torch.randn(M, K, generator=g).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype)
    ref = x.double() @ dequantize_blocks(w, s, block).T + bias.double()
    out = block_fp8_linear(x.to(DEVICE), w.to(DEVICE), s.to(DEVICE), block, bias.to(DEVICE)).cpu()
    assert out.dtype == dtype and out.shape == (M, N)
    # the output is rounded to the activations' dtype (bf16: 8 bits of mantissa)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_method_keeps_the_checkpoint_blocks():
    """A weight that came from FP8 blocks (each block's max 448 x its factor) quantizes back
    to the same bytes; apply = F.linear on the dequantized weight."""
    g = torch.Generator().manual_seed(0)
    q, s = quantize_block_fp8(torch.randn(192, 256, generator=g), (128, 128))
    layer = torch.nn.Module()
    method = Fp8LinearMethod((128, 128))
    method.create_weights(layer, 256, 192)
    layer.weight.data.copy_(dequantize_blocks(q, s, (128, 128)).float())
    method.process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))
    torch.testing.assert_close(layer.weight_scale_inv, s, rtol=1e-6, atol=0)
    x = torch.randn(5, 256, generator=g)
    ref = torch.nn.functional.linear(x.double(), dequantize_blocks(q, s, (128, 128)))
    torch.testing.assert_close(method.apply(layer, x).double(), ref, atol=1e-5, rtol=1e-5)


SCRIPT = r"""
import json, torch
from pagedllm.kernels.triton_aot import compile_launch
from pagedllm.models.layers.fp8_linear import block_fp8_matmul_launch
out = []
for M in (1, 256):        # a decode step, a prefill chunk; DeepSeek-V3's o_proj shape
    N, K = 7168, 16384
    x = torch.zeros(M, K, dtype=torch.bfloat16)
    w = torch.zeros(N, K, dtype=torch.float8_e4m3fn)
    s = torch.zeros(N // 128, K // 128)
    launch = block_fp8_matmul_launch(x, w, s, (128, 128), torch.zeros(M, N, dtype=torch.bfloat16))
    out.append(dict(M=M, **compile_launch(launch, 90)))
print(json.dumps(out))
"""


def test_block_fp8_matmul_compiles_for_sm90():
    variants = run_aot_script(SCRIPT)
    assert len(variants) == 2 and all(v["fits"] and not v["local"] for v in variants), variants
