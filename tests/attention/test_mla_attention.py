"""MLA attention (attention/backends/torch_sdpa/mla.py, attention/backends/triton_attn/mla.py) on random inputs against a
float64 per-token loop written here from the definition: decompress every cached latent
(k_nope = W_UK c, v = W_UV c), score q_nope . k_nope + q_pe . k_pe, softmax, sum of p v.

A batch mixes a prefill without past, prefill chunks with cached past and decodes, over
shuffled physical blocks of size 4; the torch path (decodes absorbed, prefills decompressed,
with the gathered-slot and the by-pages metadata) and the Triton kernel (every token absorbed;
on a GPU when there is one, else under TRITON_INTERPRET=1, which conftest.py sets) must both
match it. Cache slots no request owns hold
NaN except the null block (a kernel reading outside its blocks fails)."""

import numpy as np
import pytest
import torch

from pagedllm.attention.backends.torch_sdpa.metadata import build_attention_metadata
from pagedllm.attention.backends.torch_sdpa.mla import mla_attention_torch

H, DN, DR, DV, R = 4, 16, 8, 12, 32
BLOCK = 4
REQS = [(0, 5), (7, 1), (21, 1), (3, 6), (33, 1), (0, 1)]  # (cached tokens, new tokens)
SCALE = (DN + DR) ** -0.5
ATOL = RTOL = 1e-4


class Batch:
    def __init__(self, seed=0, heads=H):
        self.H = H = heads
        g = torch.Generator().manual_seed(seed)
        rng = np.random.default_rng(seed)
        seq_lens = np.array([c + n for c, n in REQS], dtype=np.int32)
        q_lens = np.array([n for _, n in REQS], dtype=np.int32)
        self.qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        nblocks = [-(-int(s) // BLOCK) for s in seq_lens]
        phys = rng.permutation(np.arange(1, sum(nblocks) + 4))  # block 0 is the null block
        self.block_table = np.zeros((len(REQS), max(nblocks)), dtype=np.int32)
        at = 0
        for i, nb in enumerate(nblocks):
            self.block_table[i, :nb] = phys[at : at + nb]
            at += nb
        S = (sum(nblocks) + 4) * BLOCK
        self.cache = torch.full((S, R + DR), float("nan"))
        self.cache[:BLOCK] = 0
        T = int(q_lens.sum())
        self.positions, slots = [], []
        for i, (c, n) in enumerate(REQS):
            for pos in range(c + n):
                slot = int(self.block_table[i, pos // BLOCK]) * BLOCK + pos % BLOCK
                if pos < c:  # cached past
                    self.cache[slot] = torch.randn(R + DR, generator=g)
                else:
                    slots.append(slot)
                    self.positions.append((i, pos))
        self.slot_mapping = torch.tensor(slots, dtype=torch.int64)
        self.seq_lens, self.q_lens = seq_lens, q_lens
        self.q_nope = torch.randn(T, H, DN, generator=g)
        self.q_pe = torch.randn(T, H, DR, generator=g)
        self.kv_c = torch.randn(T, R, generator=g)
        self.k_pe = torch.randn(T, DR, generator=g)
        self.w_kv_b = torch.randn(H * (DN + DV), R, generator=g) / R**0.5

    def reference(self) -> torch.Tensor:
        cache = self.cache.double().clone()
        cache[self.slot_mapping] = torch.cat((self.kv_c, self.k_pe), -1).double()
        H = self.H
        w = self.w_kv_b.double().view(H, DN + DV, R)
        out = torch.empty(len(self.positions), H, DV, dtype=torch.float64)
        for t, (i, pos) in enumerate(self.positions):
            keys = np.arange(pos + 1)
            slots = torch.from_numpy(self.block_table[i, keys // BLOCK].astype(np.int64) * BLOCK + keys % BLOCK)
            c, k_pe = cache[slots, :R], cache[slots, R:]  # [L, R], [L, DR]
            k_nope = torch.einsum("hdr,lr->hld", w[:, :DN], c)  # [H, L, DN]
            v = torch.einsum("hdr,lr->hld", w[:, DN:], c)  # [H, L, DV]
            s = (torch.einsum("hd,hld->hl", self.q_nope[t].double(), k_nope) + self.q_pe[t].double() @ k_pe.T) * SCALE
            out[t] = torch.einsum("hl,hld->hd", s.softmax(-1), v)
        return out

    def args(self):
        return self.q_nope, self.q_pe, self.kv_c, self.k_pe


@pytest.mark.parametrize("by_pages", [False, True])
def test_torch_path_equals_definition(by_pages):
    b = Batch()
    meta = build_attention_metadata(b.qsl, b.seq_lens, b.block_table, BLOCK, b.slot_mapping, decode_by_pages=by_pages)
    assert meta.decode_token_idx is not None and len(meta.prefills) == 2  # both forms run
    cache = b.cache.clone()
    out = mla_attention_torch(*b.args(), cache, b.w_kv_b, meta, SCALE)
    torch.testing.assert_close(out.double(), b.reference(), atol=ATOL, rtol=RTOL)
    new = torch.cat((b.kv_c, b.k_pe), -1)
    assert torch.equal(cache[b.slot_mapping], new)  # the latent rows were written, exactly


@pytest.mark.parametrize("heads", [4, 20])
def test_triton_kernel_equals_definition_and_torch_path(heads):
    """4 heads: a program takes 4 tokens x 4 heads of a prefill chunk; 20: 16 heads of one token
    (two head blocks, the second partly masked)."""
    pytest.importorskip("triton")
    from pagedllm.attention.backends.triton_attn.metadata import build_triton_metadata
    from pagedllm.attention.backends.triton_attn.mla import mla_attention_triton

    b = Batch(seed=1, heads=heads)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tmeta = build_triton_metadata(b.qsl, b.seq_lens, b.block_table, BLOCK, b.slot_mapping, device=dev)
    cache = b.cache.clone().to(dev)
    out = mla_attention_triton(*(x.to(dev) for x in b.args()), cache, b.w_kv_b.to(dev), tmeta, SCALE).cpu()
    torch.testing.assert_close(out.double(), b.reference(), atol=ATOL, rtol=RTOL)
    assert torch.equal(cache.cpu()[b.slot_mapping], torch.cat((b.kv_c, b.k_pe), -1))
    meta = build_attention_metadata(b.qsl, b.seq_lens, b.block_table, BLOCK, b.slot_mapping)
    torch_out = mla_attention_torch(*b.args(), b.cache.clone(), b.w_kv_b, meta, SCALE)
    torch.testing.assert_close(out, torch_out, atol=ATOL, rtol=RTOL)
