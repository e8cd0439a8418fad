"""The Triton kernels compiled for GPUs that are not here: sm_80 (A100) and sm_90 (H100/H200).

Triton's interpreter (test_triton_kernels.py) checks what the kernels compute, not that they
compile: types, tile shapes, tl.dot operands, loop-carried values, shared memory and register
pressure exist only in the real compiler's output. tools/aot_attention.py takes the
launches the engine makes for a model shape (decode, split-K with its reduction, prefill, a
mixed batch, CUDA-graph decode steps), specialises them as Triton's launcher does on a GPU,
and compiles each to a cubin with Triton's own ptxas; no GPU or driver is needed.

It runs in a subprocess without TRITON_INTERPRET, which conftest.py sets for the test process
on a machine without a GPU: interpreted kernels cannot be compiled.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton): GPU kernels untested")

KERNELS = {"reshape_and_cache_kernel", "unified_attention_kernel", "reduce_splits_kernel"}
DTYPES = ["float32", "bfloat16", "float16"]
ARCHS = [80, 90]
ROOT = Path(__file__).resolve().parents[2]


def run_tool(*args: str) -> dict:
    """tools/aot_attention.py --json with these arguments, in a subprocess without
    TRITON_INTERPRET, this checkout's pagedllm first on the path -> its report."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    res = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "aot_attention.py"), "--json", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return json.loads(res.stdout)


# Two shapes cover every path and every tile configuration (triton_attn/paged_attention.py _tile_shapes) the
# engine compiles: per dtype, decode / prefill / split-K and its reduction / CUDA-graph steps;
# a GQA ratio that is not a power of two (masked rows), head_dim 64 and 128 (HEAD_PAD), a KV
# tile spanning two blocks (BLOCK_N 32 > 16) and within one (BLOCK_N 16, 32 <= 32). Llama-3.2-1B
# ((32, 8), 64, 16), once a third shape here, compiles the same BLOCK_M / BLOCK_N / HEAD_PAD /
# num_warps tiles as the default model: only BLOCK_Q and the head counts differ.
@pytest.mark.parametrize(
    "heads,head_dim,block_size",
    [
        ((9, 3), 64, 16),  # SmolLM2-135M (the default model): GQA 3
        ((64, 8), 128, 32),  # a 70B-like layer: GQA 8, head_dim 128, blocks of 32
    ],
)
def test_engine_kernels_compile_for_sm80_and_sm90(heads, head_dim, block_size):
    report = run_tool(
        "--arch",
        *map(str, ARCHS),
        "--dtype",
        *DTYPES,
        "--heads",
        *map(str, heads),
        "--head-dim",
        str(head_dim),
        "--block-size",
        str(block_size),
    )
    variants = report["variants"]
    assert {v["kernel"] for v in variants} == KERNELS
    for arch in ARCHS:
        for dtype in DTYPES:
            mine = [v for v in variants if v["arch"] == arch and v["dtype"] == dtype]
            # every scenario's attention kernel was compiled (some share a variant)
            covered = {s for v in mine if v["kernel"] == "unified_attention_kernel" for s in v["scenarios"]}
            assert covered == set(report["scenarios"]) and len(covered) >= 7, (arch, dtype)
    too_big = [v for v in variants if not v["fits_shared"]]
    assert not too_big, f"shared memory over the architecture's limit: {too_big}"
    spills = [
        (v["arch"], v["dtype"], v["kernel"], v["constexprs"], v["num_warps"], v["local"])
        for v in variants
        if v["local"]
    ]
    assert not spills, f"variants using local memory (register spills): {spills}"


def test_quantized_kv_kernels_compile_for_sm90():
    """An int8 / fp8 KV cache (attention/kv_quant.py): the write kernel's quantisation and the
    attention kernel's scaled reads, for the default model's shape on a bf16 model. The mixed
    step covers both kernels' quantized code (split-K and graphs change only tile constants)."""
    variants = run_tool(
        "--arch",
        "90",
        "--dtype",
        "bfloat16",
        "--heads",
        "9",
        "3",
        "--head-dim",
        "64",
        "--scenario",
        "mixed",
        "--kv-cache-dtype",
        "int8",
        "fp8_e4m3",
        "fp8_e5m2",
    )["variants"]
    for kv in ("int8", "fp8_e4m3", "fp8_e5m2"):
        mine = {v["kernel"] for v in variants if v["kv_cache_dtype"] == kv}
        assert mine == {"reshape_and_cache_kernel", "unified_attention_kernel"}, (kv, mine)
    assert not [v for v in variants if v["local"] or not v["fits_shared"]], variants
