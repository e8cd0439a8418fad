"""Compile Triton kernel launches for a GPU that is not here (ahead of time, no driver).

Triton's interpreter checks what the kernels compute but not that they compile: types, tile
shapes, ``tl.dot`` operands and loop-carried values are checked only by the real compiler,
and shared memory and registers only exist in its output. This module takes a launch as the
engine would make it (a `KernelLaunch`, kernels/triton_launch.py, on CPU tensors laid out as
the engine lays them out), specialises it as Triton's launcher would on a GPU (ints equal to 1
become constants, pointers and ints divisible by 16 get that hint), and compiles it to a cubin
for a chosen architecture with Triton's own ptxas: its shared memory against the
architecture's limit, and its registers and local memory (spills) from cuobjdump.

The command-line reports are tools/aot_attention.py (the attention kernels, every step shape
the engine launches) and tools/aot_mla.py (MLA's kernel); the LoRA, fused-MoE and FP8 kernels'
tests call `compile_launch` directly. Run with TRITON_INTERPRET unset (under the interpreter the
kernels are not compilable objects). The launcher internals used here are Triton 3.9's (the
version pyproject pins).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

from pagedllm.kernels.triton_launch import KernelLaunch

# Dynamic shared memory a block may opt into (CUDA occupancy tables), bytes.
MAX_SHARED = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


def gpu_target(arch: int):
    """Triton's target for an NVIDIA GPU of compute capability sm_<arch> (80, 90, ...)."""
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", arch, 32)


def specialise(launch: KernelLaunch, target):
    """(signature, constexprs, attrs, options) as Triton's launcher derives them on a device of
    ``target`` from the launch's arguments."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    if not hasattr(fn, "params"):
        raise RuntimeError("the kernels are interpreted (TRITON_INTERPRET is set): unset it")
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = {**launch.constexprs, **launch.options}
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    return fn._pack_args(backend, kwargs, bound_args, specialization, options)


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, local bytes) per thread of a cubin's one kernel, from cuobjdump."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:\d+\s+LOCAL:(\d+)", text)
    if m is None:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{text}")
    return int(m.group(1)), int(m.group(2)) + int(m.group(3))


def compile_launch(launch: KernelLaunch, arch: int) -> dict:
    """One launch description compiled for sm_<arch>: its shared memory (and whether it fits the
    architecture), registers and local bytes per thread."""
    import triton
    from triton.compiler import ASTSource

    target = gpu_target(arch)
    options, signature, constexprs, attrs = specialise(launch, target)
    ck = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs), target=target, options=options.__dict__)
    regs, local = resource_usage(ck.asm["cubin"])
    shared = int(ck.metadata.shared)
    return dict(shared=shared, fits=shared <= MAX_SHARED[arch], registers=regs, local=local)
