"""The Triton backend (GPU; on the CPU under TRITON_INTERPRET=1 for the tests): backend.py, its
step metadata (metadata.py), the launches (paged_attention.py), the kernels (kernels.py) and
MLA's latent-attention kernel (mla.py)."""

from pagedllm.attention.backends.triton_attn.backend import TritonAttentionBackend

__all__ = ["TritonAttentionBackend"]
