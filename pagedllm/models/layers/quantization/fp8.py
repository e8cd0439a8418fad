"""FP8 checkpoints as DeepSeek-V3 ships them (config.json `quantization_config`: quant_method
"fp8", fmt "e4m3", activation_scheme "dynamic", weight_block_size [128, 128]): each quantized
linear's `weight` is float8_e4m3fn [N, K] beside `weight_scale_inv` float32
[ceil(N / bn), ceil(K / bk)], one factor per [bn, bk] block (the name is DeepSeek's: the
stored value times it is the weight). Other tensors (embeddings, norms, the LM head) are in
the checkpoint's float dtype.

Loading upcasts each such weight once, as it streams past (one log line says so): on the
CPU (or a GPU before compute capability 8.9) to the model's dtype, for every linear method;
on an sm_89+ GPU to float32, for the projections that then quantize back to the same blocks
and compute in FP8 (models/layers/fp8_linear.py, `use_fp8_gemm`). `Fp8Config` is the method's
registry class (registry.py: "fp8", read from config.json, with any --quantization).
"""

from __future__ import annotations

import logging
from typing import Iterable, Iterator, Optional

import torch

logger = logging.getLogger(__name__)

SCALE_SUFFIX = "_scale_inv"


def fp8_block_size(hf_config: dict) -> Optional[tuple[int, int]]:
    """The checkpoint's FP8 block shape, or None when it is not an FP8 checkpoint; ValueError
    for an FP8 scheme this loader does not read."""
    qc = hf_config.get("quantization_config")
    if not qc or qc.get("quant_method") != "fp8":
        return None
    if qc.get("fmt", "e4m3") != "e4m3" or qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            f"quantization_config: only fp8 e4m3 weights with dynamic activation scales "
            f"are supported, got fmt {qc.get('fmt')!r}, activation_scheme "
            f"{qc.get('activation_scheme')!r}"
        )
    block = qc.get("weight_block_size") or [128, 128]
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(f"quantization_config.weight_block_size must be two positive ints, got {block!r}")
    return block[0], block[1]


def dequantize_block_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """weight [N, K] float8_e4m3fn, scale_inv [ceil(N / bn), ceil(K / bk)] -> [N, K] of dtype
    (the product in float32, rounded once to dtype)."""
    N, K = weight.shape
    bn, bk = block
    if tuple(scale_inv.shape) != (-(-N // bn), -(-K // bk)):
        raise ValueError(
            f"weight_scale_inv of shape {tuple(scale_inv.shape)} does not fit a [{N}, {K}] "
            f"weight in blocks of {list(block)}"
        )
    s = scale_inv.float().repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]  # [N, K]
    return (weight.float() * s).to(dtype)


def upcast_fp8_weights(
    weights: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) stream with each FP8 weight and its scale joined into one
    weight of dtype (they may come in either order, in different files); the rest unchanged."""
    logger.info("FP8 checkpoint (blocks of %s): upcasting its FP8 weights to %s at load", list(block), dtype)
    pending_w: dict[str, torch.Tensor] = {}
    pending_s: dict[str, torch.Tensor] = {}
    for name, t in weights:
        if name.endswith(SCALE_SUFFIX):
            base = name[: -len(SCALE_SUFFIX)]
            if base in pending_w:
                yield base, dequantize_block_fp8(pending_w.pop(base), t, block, dtype)
            else:
                pending_s[base] = t
        elif t.dtype == torch.float8_e4m3fn:
            if name in pending_s:
                yield name, dequantize_block_fp8(t, pending_s.pop(name), block, dtype)
            else:
                pending_w[name] = t
        else:
            yield name, t
    if pending_w or pending_s:
        raise ValueError(
            f"FP8 weights without their {SCALE_SUFFIX} (or scales without weights): "
            f"{sorted(pending_w)[:3] + sorted(pending_s)[:3]}"
        )


def use_fp8_gemm(model, block: tuple[int, int], device: torch.device) -> bool:
    """On an sm_89+ GPU the FP8 projections keep FP8 weights (Fp8LinearMethod); else False."""
    from pagedllm.models.layers.fp8_linear import fp8_supported, use_fp8_linears

    if not fp8_supported(device):
        return False
    logger.info(
        "FP8 checkpoint: %d linears compute with block-FP8 weights (Triton GEMM)", use_fp8_linears(model, block)
    )
    return True


class Fp8Config:
    """The checkpoint's own quantization (registry.py: from config.json, any --quantization):
    its FP8 weights are upcast as they stream past, the projections then computed by whatever
    LinearMethod the layers have (or in FP8 on an sm_89+ GPU)."""

    name = "fp8"

    def __init__(self, block: tuple[int, int]) -> None:
        self.block = block

    @classmethod
    def from_quant_args(cls, group_size, model_dir, hf_config: dict) -> "Fp8Config":
        return cls(fp8_block_size(hf_config))

    def process_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], model, device: str, dtype: torch.dtype
    ) -> Iterator[tuple[str, torch.Tensor]]:
        fp8_gemm = use_fp8_gemm(model, self.block, torch.device(device))
        return upcast_fp8_weights(weights, self.block, torch.float32 if fp8_gemm else dtype)
