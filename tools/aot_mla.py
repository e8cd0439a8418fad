"""Compile MLA's latent-attention Triton kernel (attention/backends/triton_attn/mla.py) for sm_80
and sm_90 at DeepSeek-V3's dims (kv_lora_rank 512, rope 64, blocks of 16), without a GPU, and
print each variant's tiles, shared memory, registers and local memory (spills). Run it with
TRITON_INTERPRET unset:

    PYTHONPATH=. python tools/aot_mla.py
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention.backends.triton_attn.metadata import build_triton_metadata
from pagedllm.attention.backends.triton_attn.mla import mla_attention_launch
from pagedllm.kernels.triton_aot import compile_launch
from pagedllm.kernels.triton_launch import KernelLaunch

AOT_SCENARIOS = [
    ("decode, 128 heads", 128, [(300, 1)] * 4),
    ("decode, 16 heads (TP 8)", 16, [(300, 1)] * 4),
    ("prefill chunk, 4 heads", 4, [(100, 64)]),
]


def aot_launch(
    num_heads: int, reqs, kv_lora_rank: int, rope_dim: int, block_size: int, dtype: torch.dtype
) -> KernelLaunch:
    """The kernel's launch for a step of requests (cached, new), with tensors laid out as the
    model makes them (q_lat / q_pe views of one absorbed query)."""
    q_lens = np.array([n for _, n in reqs])
    seq_lens = np.array([c + n for c, n in reqs], dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    T, nb = int(qsl[-1]), int(-(-seq_lens.max() // block_size))
    meta = build_triton_metadata(
        qsl,
        seq_lens,
        np.zeros((len(reqs), nb), dtype=np.int32),
        block_size,
        torch.zeros(T, dtype=torch.int64),
        max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()),
    )
    q = torch.zeros(T, num_heads, kv_lora_rank + rope_dim, dtype=dtype)
    cache = torch.zeros((1 + len(reqs) * nb) * block_size, kv_lora_rank + rope_dim, dtype=dtype)
    return mla_attention_launch(
        q[..., :kv_lora_rank],
        q[..., kv_lora_rank:],
        cache,
        meta,
        0.1,
        torch.zeros(T, num_heads, kv_lora_rank, dtype=dtype),
    )


def main() -> None:
    print("arch dtype     scenario                  BLOCK_Q BLOCK_H BLOCK_N warps shared regs local")
    for arch in (80, 90):
        for dtype in (torch.bfloat16, torch.float32):
            for name, heads, reqs in AOT_SCENARIOS:
                launch = aot_launch(heads, reqs, 512, 64, 16, dtype)
                r = compile_launch(launch, arch)
                c = launch.constexprs
                print(
                    f"sm_{arch} {str(dtype)[6:]:9} {name:25} {c['BLOCK_Q']:7} {c['BLOCK_H']:7} "
                    f"{c['BLOCK_N']:7} {launch.options['num_warps']:5} {r['shared']:6} "
                    f"{r['registers']:4} {r['local']:5}"
                )


if __name__ == "__main__":
    main()
