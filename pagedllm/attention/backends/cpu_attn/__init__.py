"""The CPU backend: the torch backend whose decodes and prefill chunks read the pages with the
C++ kernels: backend.py, its forward (paged_attention.py), the kernels' handles (kernels.py;
the C++ is csrc/attention.cpp and csrc/prefill_attention.cpp). Its metadata and MLA path are
the torch backend's (backends/torch_sdpa/)."""

from pagedllm.attention.backends.cpu_attn.backend import CPUAttentionBackend

__all__ = ["CPUAttentionBackend"]
