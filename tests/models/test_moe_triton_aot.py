"""The grouped MoE matmul kernel compiled for GPUs that are not here: sm_80 (A100) and sm_90
(H100/H200) in bfloat16 (float16 takes the same tiles), and float32 on sm_90 (its own
tiles), both launches of a layer (gate_up with TOP_K rows per
token, down with the routing weight), through kernels/triton_aot.py: the launch
descriptions the layer makes, specialised as Triton's launcher would on a GPU, compiled to
cubins with Triton's ptxas; shared memory within the architecture's limit and no register
spills. Runs in a subprocess without TRITON_INTERPRET (interpreted kernels do not compile)."""

import pytest
from kernel_utils import run_aot_script

pytest.importorskip("triton", reason="triton is not installed (pip install triton): GPU kernels untested")

SCRIPT = r"""
import json, torch
from pagedllm.kernels.triton_aot import compile_launch
from pagedllm.models.layers.fused_moe_triton import fused_experts_launches
out = []
for arch, dtype in ((80, torch.bfloat16), (90, torch.bfloat16), (90, torch.float32)):
    # Qwen3-30B-A3B's expert shape (H 2048, I 768, 8 experts per token), 37 tokens; 8 experts
    # of its 128 (their number is only a stride, as divisible by 16 either way).
    T, H, I, E, k = 37, 2048, 768, 8, 8
    hidden = torch.zeros(T, H, dtype=dtype)
    w13, w2 = torch.zeros(E, 2 * I, H, dtype=dtype), torch.zeros(E, H, I, dtype=dtype)
    ids = torch.randint(0, E, (T, k))
    up, _, down, _, _ = fused_experts_launches(hidden, w13, w2, torch.rand(T, k), ids)
    for name, launch in (("gate_up", up), ("down", down)):
        out.append(dict(arch=arch, dtype=str(dtype), launch=name, **compile_launch(launch, arch)))
print(json.dumps(out))
"""


def test_grouped_moe_kernel_compiles_for_sm80_and_sm90():
    variants = run_aot_script(SCRIPT)
    assert len(variants) == 3 * 2
    assert all(v["fits"] for v in variants), variants
    assert not [v for v in variants if v["local"]], f"register spills: {variants}"
