"""The CPU backend: the torch backend whose decodes and prefill chunks read K/V through the
block table with the C++ `paged_decode` and `paged_prefill` kernels (kernels.py, called by
paged_attention.py) instead of gathering slots. Chosen by the selector only where the decode
kernel builds for the cache's dtype; prefill chunks of a quantized cache (or a head_dim the
prefill kernel does not take) keep SDPA."""

from __future__ import annotations

from pagedllm.attention.backends.cpu_attn.paged_attention import paged_attention
from pagedllm.attention.backends.torch_sdpa.backend import TorchSDPABackend


class CPUAttentionBackend(TorchSDPABackend):
    name = "cpu"
    decode_by_pages = True  # metadata carries the decodes' block table and lengths, no slot matrix
    prefill_by_pages = True  # and the prefill chunks' (PrefillPages); their masks only on demand
    # A request with up to 1 + 16 (the most drafts) new tokens over a past, a speculative
    # verification above all, attends as one decode query per token (torch_sdpa/metadata.py):
    # the calls its tokens' one-token decodes make, and the C++ decode loop can take the step.
    max_decode_query_len = 17
    attend = staticmethod(paged_attention)
