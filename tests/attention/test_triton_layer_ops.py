"""The fused Triton layer ops (models/layers/triton_ops.py) against the layers' torch code
(the layers built with ops=None), on the CPU under TRITON_INTERPRET=1 (conftest sets it where
there is no GPU), in float32 and bfloat16: RMSNorm with and without the residual add,
SiLU-and-mul, RoPE in place on views of a QKV product (partial rotary included)."""

import pytest
import torch

pytest.importorskip("triton")

from pagedllm.models.layers.activation import SiluAndMul  # noqa: E402
from pagedllm.models.layers.layernorm import RMSNorm  # noqa: E402
from pagedllm.models.layers.rotary_embedding import RotaryEmbedding  # noqa: E402
from pagedllm.models.layers.triton_ops import TritonOps  # noqa: E402

OPS = TritonOps()
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# float32: the sum's order and rsqrt / exp's last bit; bfloat16: two units in the last place (a
# last-bit difference before an intermediate rounding carries through the next product)
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}


def _torch_layer(layer):
    layer.ops = None  # the torch code
    return layer.to(DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,N", [(5, 64), (3, 96)])  # 96: a masked tail of the 128-wide block
def test_rms_norm(dtype, T, N):
    g = torch.Generator().manual_seed(T * N)
    norm = _torch_layer(RMSNorm(N, 1e-5))
    norm.weight.data = (1 + 0.1 * torch.randn(N, generator=g)).to(DEV, dtype)
    x, res = (torch.randn(T, N, generator=g).mul(3).to(DEV, dtype) for _ in range(2))
    torch.testing.assert_close(OPS.rms_norm(x, norm.weight, norm.eps), norm(x), **TOL[dtype])
    out, new_res = OPS.fused_add_rms_norm(x, res, norm.weight, norm.eps)
    ref_out, ref_res = norm(x, res)
    # the add rounds once, as torch's: equal on a GPU; Triton's interpreter truncates float32
    # to bfloat16 (rounding aside, one unit in the last place)
    torch.testing.assert_close(new_res, ref_res, atol=0, rtol=0 if DEV == "cuda" else 2**-7)
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    assert OPS.rms_norm(x[:0], norm.weight, norm.eps).shape == (0, N)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,I", [(4, 48), (2, 1500)])  # 1500: two column blocks, the last masked
def test_silu_and_mul(dtype, T, I):
    x = torch.randn(T, 2 * I, generator=torch.Generator().manual_seed(I)).mul(4).to(DEV, dtype)
    torch.testing.assert_close(OPS.silu_and_mul(x), _torch_layer(SiluAndMul())(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,Hkv,D,partial", [(6, 2, 64, 1.0), (4, 4, 32, 0.5)])
def test_rotary_in_place_on_qkv_views(dtype, H, Hkv, D, partial):
    g = torch.Generator().manual_seed(H * D)
    hf = {"rope_theta": 10000.0, "partial_rotary_factor": partial}
    with torch.device(DEV):
        torch.set_default_dtype(dtype)
        try:
            rope = RotaryEmbedding(hf, D, 64)
        finally:
            torch.set_default_dtype(torch.float32)
    rope.ops = None
    T = 7
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(DEV, dtype)
    positions = torch.tensor([0, 3, 5, 9, 17, 40, 63], device=DEV)
    q = qkv[:, : H * D].view(T, H, D)
    k = qkv[:, H * D : (H + Hkv) * D].view(T, Hkv, D)
    v_before = qkv[:, (H + Hkv) * D :].clone()
    ref_q, ref_k = rope(positions, q.clone(), k.clone())
    OPS.rotary_embedding_(q, k, rope.cos, rope.sin, positions)
    torch.testing.assert_close(q, ref_q, **TOL[dtype])
    torch.testing.assert_close(k, ref_k, **TOL[dtype])
    assert torch.equal(qkv[:, (H + Hkv) * D :], v_before)  # v untouched
