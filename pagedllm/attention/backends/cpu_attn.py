"""The CPU backend: the torch backend whose decodes read K/V through the block table with the
C++ `paged_decode` kernel (attention/cpu_kernels.py) instead of gathering slots. Chosen by the
selector only where that kernel builds for the cache's dtype."""
from __future__ import annotations

from pagedllm.attention.backends.torch_sdpa import TorchSDPABackend


class CPUAttentionBackend(TorchSDPABackend):
    name = "cpu"
    decode_by_pages = True   # metadata carries the decodes' block table and lengths, no slot matrix
