"""Which fused element-wise ops a layer uses, decided once when it is built: the C++ ops where
it is built on the CPU (models/cpu_ops.py), the Triton kernels where it is built on a CUDA
device (models/layers/triton_ops.py), else None (the layer's torch code)."""

from __future__ import annotations

import torch

from pagedllm.models.cpu_ops import fused_cpu_ops


def fused_layer_ops():
    ops = fused_cpu_ops()
    if ops is None and torch.get_default_device().type == "cuda":
        from pagedllm.models.layers.triton_ops import fused_gpu_ops  # triton only where it runs

        ops = fused_gpu_ops()
    return ops
