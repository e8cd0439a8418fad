"""A paged attention batch for the kernel tests (test_triton_kernels.py on the CPU under Triton's
interpreter, test_gpu_kernels.py on a GPU): requests given as (num_cached, num_new) pairs, laid
out as the model runner does, with references computed without the Triton kernels."""

import copy

import numpy as np
import torch

from pagedllm.attention.backends.torch_sdpa import paged_attention as torch_sdpa
from pagedllm.attention.backends.torch_sdpa.metadata import build_attention_metadata
from pagedllm.attention.backends.triton_attn.metadata import build_triton_metadata


class Batch:
    """Requests given as (num_cached, num_new) pairs, laid out as the model runner does."""

    def __init__(
        self, reqs, block_size, num_heads, num_kv_heads, head_dim, seed=0, dtype=torch.float32, num_pad_tokens=0
    ):
        g = torch.Generator().manual_seed(seed)
        rng = np.random.default_rng(seed)
        self.block_size, self.head_dim = block_size, head_dim
        ctx = np.array([c for c, _ in reqs], dtype=np.int64)
        q_lens = np.array([n for _, n in reqs], dtype=np.int64)
        self.seq_lens = (ctx + q_lens).astype(np.int32)
        self.query_start_loc = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        nblocks = -(-self.seq_lens.astype(np.int64) // block_size)
        self.num_blocks = int(nblocks.sum()) + 5  # + null block 0 + spares
        # Shuffled physical ids (never the null block 0); unused table columns point at block 0.
        phys = rng.permutation(np.arange(1, self.num_blocks)).astype(np.int32)
        self.block_table = np.zeros((len(reqs), int(nblocks.max()) + 2), dtype=np.int32)
        k = 0
        for r, n in enumerate(nblocks):
            self.block_table[r, :n] = phys[k : k + n]
            k += n
        T = int(q_lens.sum())
        req = np.repeat(np.arange(len(reqs)), q_lens)
        positions = np.concatenate([np.arange(c, c + n) for c, n in reqs])
        slots = self.block_table[req, positions // block_size].astype(np.int64) * block_size + positions % block_size
        self.slot_mapping = torch.from_numpy(np.concatenate([slots, np.full(num_pad_tokens, -1)]))
        self.num_tokens = T + num_pad_tokens

        # Cache: null block zeros, every slot no request owns NaN, cached past random.
        S = self.num_blocks * block_size
        self.k_cache = torch.full((S, num_kv_heads, head_dim), float("nan"))
        self.v_cache = torch.full((S, num_kv_heads, head_dim), float("nan"))
        self.k_cache[:block_size] = 0
        self.v_cache[:block_size] = 0
        past = [
            self.block_table[r, p // block_size] * block_size + p % block_size
            for r, (c, _) in enumerate(reqs)
            for p in range(c)
        ]
        past = torch.tensor(past, dtype=torch.int64)
        self.k_cache[past] = torch.randn(len(past), num_kv_heads, head_dim, generator=g)
        self.v_cache[past] = torch.randn(len(past), num_kv_heads, head_dim, generator=g)
        self.k_cache, self.v_cache = self.k_cache.to(dtype), self.v_cache.to(dtype)
        # This step's q, k, v as non-contiguous views of one fused projection, as in the model.
        H, Hkv, D = num_heads, num_kv_heads, head_dim
        qkv = torch.randn(self.num_tokens, (H + 2 * Hkv) * D, generator=g).to(dtype)
        q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        self.q = q.view(-1, H, D)
        self.k = k.view(-1, Hkv, D)
        self.v = v.view(-1, Hkv, D)
        self.scale = D**-0.5

    def on(self, device, dtype=None) -> "Batch":
        """A copy whose q, k, v, caches (cast to dtype) and slot mapping live on device; the
        host arrays and the references stay with this one."""
        other = copy.copy(self)
        for name in ("q", "k", "v", "k_cache", "v_cache"):
            t = getattr(self, name)
            setattr(other, name, t.to(device, dtype or t.dtype))
        other.slot_mapping = self.slot_mapping.to(device)
        return other

    def caches(self):
        return self.k_cache.clone(), self.v_cache.clone()

    def triton_meta(self, **kw):
        return build_triton_metadata(
            self.query_start_loc, self.seq_lens, self.block_table, self.block_size, self.slot_mapping, **kw
        )

    def torch_reference(self):
        """The torch backend on the real (unpadded) tokens: (out, k_cache, v_cache)."""
        T = int(self.query_start_loc[-1])
        kc, vc = self.caches()
        meta = build_attention_metadata(
            self.query_start_loc, self.seq_lens, self.block_table, self.block_size, self.slot_mapping[:T]
        )
        out = torch_sdpa.paged_attention(self.q[:T], self.k[:T], self.v[:T], kc, vc, meta, self.scale)
        return out, kc, vc

    def loop_reference(self):
        """A float64 loop per request over its logical blocks, independent of both backends."""
        T = int(self.query_start_loc[-1])
        kc, vc = self.caches()
        kc[self.slot_mapping[:T]] = self.k[:T]
        vc[self.slot_mapping[:T]] = self.v[:T]
        H, Hkv = self.q.shape[1], kc.shape[1]
        out = torch.empty(T, H, self.head_dim, dtype=torch.float64)
        for r in range(len(self.seq_lens)):
            s, a, b = int(self.seq_lens[r]), int(self.query_start_loc[r]), int(self.query_start_loc[r + 1])
            pos = np.arange(s)
            slots = torch.from_numpy(
                self.block_table[r, pos // self.block_size].astype(np.int64) * self.block_size + pos % self.block_size
            )
            keys = kc[slots].double().repeat_interleave(H // Hkv, dim=1)  # [s, H, D]
            vals = vc[slots].double().repeat_interleave(H // Hkv, dim=1)
            qr = self.q[a:b].double()  # [n, H, D]
            scores = torch.einsum("nhd,shd->hns", qr, keys) * self.scale
            q_pos = torch.arange(s - (b - a), s)
            scores = scores.masked_fill(torch.arange(s)[None, :] > q_pos[:, None], float("-inf"))
            out[a:b] = torch.einsum("hns,shd->nhd", scores.softmax(-1), vals)
        return out.float()


def mixed_reqs(bs):
    """Prefill with no past, decodes, chunks with past, all crossing block boundaries."""
    return [
        (0, bs + 3),  # first chunk of a prompt, no past, crosses a block boundary
        (2 * bs + 5, 1),  # decode, context crosses two boundaries
        (bs + 5, bs // 2 + 7),  # later chunk with cached past: causal inside, full over the past
        (2 * bs - 1, 1),  # decode writing the last slot of a block (seq_len = 2 * bs)
        (0, 1),  # a one-token prompt (q_len 1, no past)
        (bs, 2),  # chunk starting exactly at a block boundary
    ]
