"""Attention backends by name: the one table that the selector, EngineArgs' check of the name and
the CLI's --attention-backend choices read. A backend is one folder, backends/<name>/, and one line here
naming its class; the class is imported only when a model is built with it (the Triton one
imports triton), so this module stays torch-free for the CLI and EngineArgs."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionBackendEntry:
    backend_class: str  # "module:Class", an AttentionBackend (backends/abstract.py)
    # Offered by --attention-backend; False: only the selector picks it ("cpu" is what "torch"
    # becomes on a CPU where the C++ decode kernel builds for the cache's dtype).
    selectable: bool = True


_PKG = "pagedllm.attention.backends"
BACKENDS: dict[str, AttentionBackendEntry] = {
    "torch": AttentionBackendEntry(f"{_PKG}.torch_sdpa:TorchSDPABackend"),
    "cpu": AttentionBackendEntry(f"{_PKG}.cpu_attn:CPUAttentionBackend", selectable=False),
    "triton": AttentionBackendEntry(f"{_PKG}.triton_attn:TritonAttentionBackend"),
}


def backend_choices() -> tuple[str, ...]:
    """The names a user may choose (--attention-backend, EngineArgs.attention_backend), 'auto' aside."""
    return tuple(name for name, entry in BACKENDS.items() if entry.selectable)


def backend_class(name: str) -> type:
    """The backend class registered under name (imported now)."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {tuple(BACKENDS)}, got {name!r}")
    module, cls = BACKENDS[name].backend_class.split(":")
    return getattr(importlib.import_module(module), cls)
