"""Which attention backend runs a model: chosen once, when the model is built.

`get_attn_backend(device, dtype, name)` maps the engine's `attention_backend` setting onto a
backend object (cached: the loader and the runner get the same one). On the CPU, "torch" is
the C++ paged-decode backend ("cpu") wherever that kernel builds for the cache's dtype, and the
plain SDPA reference elsewhere. The model's `Attention` layers take the backend that is current
while they are constructed (`set_current_attn_backend`), as vLLM's layers read the config that
is current while the model is built.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Optional

import torch

from pagedllm.attention.backends.abstract import AttentionBackend
from pagedllm.attention.backends.cpu_attn import kernels as cpu_kernels
from pagedllm.attention.backends.registry import BACKENDS, backend_class

BACKEND_NAMES = tuple(BACKENDS)


@functools.lru_cache(maxsize=None)
def _backend(device: torch.device, name: str) -> AttentionBackend:
    return backend_class(name)(device)


def get_attn_backend(device, dtype: torch.dtype, name: str = "torch") -> AttentionBackend:
    """name: "torch" (the CPU's: paged C++ decode when it builds, else SDPA), "cpu" (the C++
    decode; an error where it cannot run), or "triton"."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention backend must be one of {BACKEND_NAMES}, got {name!r}")
    device = torch.device(device)
    # (Asked only for the CPU's names: the question builds the C++ kernel.)
    by_pages = name != "triton" and device.type == "cpu" and cpu_kernels.cpu_decode_supported(dtype)
    if name == "torch" and by_pages:
        name = "cpu"
    elif name == "cpu" and not by_pages:
        raise ValueError(
            f"the cpu attention backend needs a CPU device, a {dtype} decode kernel "
            "and a C++ compiler (attention/backends/cpu_attn/kernels.py)"
        )
    return _backend(device, name)


_current: Optional[AttentionBackend] = None


@contextlib.contextmanager
def set_current_attn_backend(backend: AttentionBackend) -> Iterator[None]:
    """Attention layers constructed inside this block use `backend`."""
    global _current
    prev, _current = _current, backend
    try:
        yield
    finally:
        _current = prev


def get_current_attn_backend() -> AttentionBackend:
    """The backend of the model being built; outside a build, the torch reference on the CPU
    (a model made directly, as the tests make small ones)."""
    return _current if _current is not None else _backend(torch.device("cpu"), "torch")
