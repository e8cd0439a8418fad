"""A Triton kernel launch described before it is made, and the small helpers every launcher
shares (attention, LoRA, fused MoE, FP8 linear). A launcher returns `KernelLaunch`es instead of
launching: `launch()` makes one on its arguments' device, and triton_aot.py compiles the same
description for a GPU that is not here (tools/aot_*.py, the AOT tests)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class KernelLaunch:
    """One kernel launch: ``launch()`` makes it on the arguments' device."""

    kernel: object  # a @triton.jit function
    grid: tuple
    args: tuple  # positional: tensors, ints, floats
    constexprs: dict
    options: dict  # num_warps, num_stages, ...

    def launch(self) -> None:
        self.kernel[self.grid](*self.args, **self.constexprs, **self.options)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton's block shapes are powers of two."""
    return 1 << max(0, int(n) - 1).bit_length()


def launch_options(num_warps: int, num_stages: Optional[int] = None) -> dict:
    """A launch's options. FMA contraction on: stated so, as Triton 3.9 warns that its default
    will change."""
    opts = {"num_warps": num_warps, "enable_fp_fusion": True}
    if num_stages is not None:
        opts["num_stages"] = num_stages
    return opts
