"""The torch backend, the reference: backend.py, its step metadata (metadata.py: gathered slots
and masks; the CPU backend's pages too), its forward (paged_attention.py: SDPA over the gathered
slots) and MLA's torch path (mla.py)."""

from pagedllm.attention.backends.torch_sdpa.backend import TorchSDPABackend

__all__ = ["TorchSDPABackend"]
