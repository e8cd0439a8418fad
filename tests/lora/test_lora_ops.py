"""Batched LoRA arithmetic: the torch shrink / expand (punica.py: per-slot segments and the
masked all-slot form over the compute layout) against a per-row dense reference, the Triton kernels under TRITON_INTERPRET=1 against the torch path, and a fused layer
wrapped by LoRALinearMethod against its merged weight, base rows exactly the base method's."""

import numpy as np
import pytest
import torch

from pagedllm.lora.layers import LoRALinearMethod
from pagedllm.lora.punica import LoRAMapping, add_lora_dense, add_lora_torch, write_compute_slot

# Tokens of 5 requests: slots 1, base, 0, 1, base (slot 1 non-contiguous).
ROW_SLOTS = [1, -1, 0, 1, -1]


def _case(dtype, T, K=40, N=50, R=8, L=3, seed=0):
    """x [T, K], A [L, R, K], B [N, L * R] (the slot layout of layers.py), y [T, N]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(dtype)
    a = (torch.randn(L, R, K, generator=g) * 0.3).to(dtype)
    b = (torch.randn(N, L * R, generator=g) * 0.3).to(dtype)
    y = torch.randn(T, N, generator=g).to(dtype)
    return x, a, b, y


def _mapping(scale: int, use_triton=False):
    """The five requests with 1 token each times `scale` (scale 1: the masked dense path; large:
    the per-slot segments)."""
    m = LoRAMapping(use_triton)
    m.set(np.repeat(np.array(ROW_SLOTS, dtype=np.int32), np.array([3, 2, 4, 1, 2]) * scale), "cpu")
    return m


@pytest.mark.parametrize("scale,dense", [(1, True), (1, False), (40, False)])
def test_torch_path_equals_dense_per_row(scale, dense):
    m = _mapping(scale)
    assert m.dense == (scale == 1)
    assert any(not isinstance(rows, slice) for _, rows in m.segments)  # a gather runs
    slots = m.token_slots.tolist()
    x, a, b, y0 = _case(torch.float32, len(slots))
    y = y0.clone()
    if dense:  # the compute layout, written slot by slot as set_lora does
        L, R, K = a.shape
        a_t, b_t = torch.full((K, L * R), float("nan")), torch.full((L * R, b.shape[0]), float("nan"))
        for s in range(L):
            write_compute_slot(a_t, b_t, a, b, s, [(0, b.shape[0])])
        add_lora_dense(y, x, a_t, b_t, [(0, b.shape[0])], R, m)
    else:
        add_lora_torch(y, x, a, b, m)
    R = a.shape[1]
    for t, s in enumerate(slots):
        if s < 0:
            assert torch.equal(y[t], y0[t])  # base rows unchanged
        else:
            want = y0[t] + b[:, s * R : (s + 1) * R] @ (a[s] @ x[t])
            torch.testing.assert_close(y[t], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_equal_torch_path(dtype):
    pytest.importorskip("triton")
    from pagedllm.lora.triton_ops import add_lora_triton

    m = _mapping(1)
    L, R, N = 3, 24, 70
    x, a, b, y0 = _case(dtype, len(m.token_slots), K=300, N=N, R=R, L=L)  # K over several tiles, R padded
    want, got = y0.clone(), y0.clone()
    add_lora_torch(want, x, a, b, m)
    add_lora_triton(got, x, a, b.view(N, L, R).permute(1, 0, 2), m.token_slots)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    base = m.token_slots < 0
    assert torch.equal(got[base], y0[base])


def test_wrapped_fused_layer_equals_merged_weight():
    """QKV with adapters of different ranks on q and v only: the block-diagonal slot gives
    x (W + B A)^T for the adapter's rows; base rows equal the unwrapped packed method exactly."""
    from pagedllm.models.layers.linear import QKVParallelLinear

    torch.manual_seed(0)
    layer = QKVParallelLinear(32, 8, range(0, 4), range(0, 2), bias=True)  # q 32, k 16, v 16 -> 64
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    layer.linear_method.process_weights_after_loading(layer)
    x = torch.randn(12, 32)
    base_y = layer(x)
    mapping = LoRAMapping()
    layer.linear_method = LoRALinearMethod(layer.linear_method, mapping)
    layer.linear_method.create_lora_weights(layer, max_loras=2, max_rank=8, dtype=torch.float32, device="cpu")
    shards = {0: (torch.randn(8, 32), torch.randn(32, 8)), 2: (torch.randn(3, 32), torch.randn(16, 3))}
    layer.linear_method.set_lora(layer, 1, shards)
    mapping.set(np.repeat(np.array([1, -1, 1], dtype=np.int32), [5, 4, 3]), "cpu")
    y = layer(x)
    delta = torch.zeros(64, 32)
    delta[0:32] = shards[0][1] @ shards[0][0]
    delta[48:64] = shards[2][1] @ shards[2][0]
    lora_rows = mapping.token_slots >= 0
    torch.testing.assert_close(y[lora_rows], base_y[lora_rows] + x[lora_rows] @ delta.t(), rtol=1e-4, atol=1e-4)
    assert torch.equal(y[~lora_rows], base_y[~lora_rows])
