"""LoRA's shrink and expand kernels compiled for GPUs that are not here, sm_80 (A100) and sm_90
(H100/H200), bfloat16 and float32, through kernels/triton_aot.py (the launch
descriptions lora_launches makes, specialised as Triton's launcher would, compiled to cubins by
Triton's ptxas): shared memory within the architecture's limit and no register spills. Shapes
of Llama-3.2-1B's fused QKV (rank 16, three slices: 48 rank columns) and down_proj. Runs in a
subprocess without TRITON_INTERPRET (interpreted kernels do not compile)."""

import pytest
from kernel_utils import run_aot_script

pytest.importorskip("triton", reason="triton is not installed (pip install triton): GPU kernels untested")

SCRIPT = r"""
import json, torch
from pagedllm.kernels.triton_aot import compile_launch
from pagedllm.lora.triton_ops import lora_launches
out = []
for arch, dtype in ((80, torch.bfloat16), (90, torch.bfloat16)):
    for name, K, N, R in (("qkv", 2048, 3072, 48), ("down", 8192, 2048, 16)):
        T, L = 37, 4
        x, y = torch.zeros(T, K, dtype=dtype), torch.zeros(T, N, dtype=dtype)
        a = torch.zeros(L, R, K, dtype=dtype)
        b = torch.zeros(N, L, R, dtype=dtype).permute(1, 0, 2)   # the slots' B as layers.py passes it
        shrink, expand, _ = lora_launches(y, x, a, b, torch.zeros(T, dtype=torch.int32))
        for kind, launch in (("shrink", shrink), ("expand", expand)):
            out.append(dict(arch=arch, dtype=str(dtype), layer=name, launch=kind, **compile_launch(launch, arch)))
print(json.dumps(out))
"""


def test_lora_kernels_compile_for_sm80_and_sm90():
    variants = run_aot_script(SCRIPT)
    assert len(variants) == 2 * 2 * 2
    print("\n".join(map(str, variants)))
    assert all(v["fits"] for v in variants), variants
    assert not [v for v in variants if v["local"]], f"register spills: {variants}"
