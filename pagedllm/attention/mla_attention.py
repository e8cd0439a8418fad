"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent cache.

Per token the cache holds only c_kv (the normed latent, kv_lora_rank) and k_pe (the rotated
decoupled RoPE key, qk_rope_head_dim), shared by every head (attention/kv_cache_spec.py
MLAAttentionSpec). The per-head keys and values are the up-projection kv_b_proj of the latent:
k_nope_h = W_UK_h c_kv, v_h = W_UV_h c_kv (kv_b_proj's weight viewed [H, dn + dv, R]). Two
equal ways to attend:

- decompressed (prefill chunks): up-project every latent of the request, then ordinary
  attention with q = [q_nope, q_pe], k = [k_nope, k_pe], v. Costs H * (dn + dv) per cached
  token, paid once for a whole chunk of queries.
- absorbed (decodes, the seeds' "matrix absorption"): q_nope^T W_UK_h c = (W_UK_h^T q_nope)^T c,
  so the query moves into the latent space (q_lat = W_UK_h^T q_nope, [R]) and attends to the
  cache rows [c_kv, k_pe] directly, as multi-query attention with one KV head of size R + dr
  and value c_kv; the output o_lat [H, R] leaves through W_UV_h. Nothing is up-projected per
  cached token.

MLA is a backend capability (`AttentionBackend.supports_mla`, `forward_mla`): the torch and CPU
backends run the torch path (backends/torch_sdpa/mla.py), the Triton backend the absorbed form
for every token in one kernel (backends/triton_attn/mla.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedllm.attention.backends.abstract import AttentionBackend
from pagedllm.attention.kv_cache_spec import KVCacheSpec, MLAAttentionSpec
from pagedllm.attention.kv_quant import is_quantized
from pagedllm.attention.layer import Attention
from pagedllm.forward_context import get_forward_context


class MLAAttention(Attention):
    """One MLA layer's attention: owns its latent cache view ((cache,), cache [S, R + dr])."""

    def __init__(
        self,
        num_heads: int,
        scale: float,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        backend: Optional[AttentionBackend] = None,
    ) -> None:
        super().__init__(num_heads, qk_nope_head_dim + qk_rope_head_dim, scale, 1, backend)
        if not self.backend.supports_mla:
            raise ValueError(
                f"the {self.backend.name} attention backend does not run MLA layers "
                "(DeepSeek): choose one whose supports_mla is set"
            )
        self.kv_lora_rank, self.v_head_dim = kv_lora_rank, v_head_dim
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        if is_quantized(dtype):
            raise ValueError(
                f"kv_cache_dtype {dtype} is not supported for MLA's latent cache (DeepSeek); use kv_cache_dtype 'auto'"
            )
        return MLAAttentionSpec(block_size, self.kv_lora_rank, self.qk_rope_head_dim, dtype)

    def forward(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, w_kv_b: torch.Tensor
    ) -> torch.Tensor:
        """q_nope [T, H, dn], q_pe [T, H, dr] (rotated), kv_c [T, R] (normed latent), k_pe [T, dr]
        (rotated), w_kv_b: kv_b_proj's weight [H * (dn + dv), R] -> out [T, H, dv]. This step's
        [kv_c, k_pe] rows are written into the cache at the slot mapping first."""
        if self.kv_cache is None:
            raise RuntimeError(
                "this MLA layer has no KV cache: the runner binds it "
                "(attention.layer.bind_kv_cache) once the cache is allocated"
            )
        return self.backend.forward_mla(
            self, q_nope, q_pe, kv_c, k_pe, w_kv_b, self.kv_cache, get_forward_context().attn_metadata
        )
