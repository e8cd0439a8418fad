"""The C++ decode kernel reads the paged cache directly; it must agree with the torch path
(which gathers the context) on random paged caches, for GQA ratios 1, 3 and 8."""
import numpy as np
import pytest
import torch

from pagedllm.attention.cpu_kernels import decode_kernel
from pagedllm.attention.metadata import build_attention_metadata
from pagedllm.attention.torch_backend import paged_attention


@pytest.mark.parametrize("H, Hkv, D, bs", [(9, 3, 64, 16), (4, 4, 32, 4), (16, 2, 64, 32)])
def test_decode_kernel_matches_torch_path(H, Hkv, D, bs):
    if decode_kernel() is None:
        pytest.skip("the C++ kernel could not be built here (no compiler / ninja)")
    rng = np.random.default_rng(H * 100 + bs)
    # A mixed batch: decodes (one new token) around a prefill chunk with a cached past.
    q_lens = np.array([1, 1, 5, 1, 1])
    seq_lens = np.array([1, 37, 20, bs, 3 * bs + 1], dtype=np.int32)
    nb = -(-seq_lens // bs)
    perm = rng.permutation(np.arange(1, nb.sum() + 1))
    table = np.zeros((len(q_lens), nb.max()), dtype=np.int32)
    c = 0
    for i, n in enumerate(nb):
        table[i, :n] = perm[c:c + n]
        c += n
    S = (nb.sum() + 1) * bs
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    pos = np.concatenate([np.arange(s - q, s) for s, q in zip(seq_lens, q_lens)])
    req = np.repeat(np.arange(len(q_lens)), q_lens)
    slots = torch.from_numpy(table[req, pos // bs].astype(np.int64) * bs + pos % bs)
    T = int(q_lens.sum())
    q, k, v = (torch.randn(T, H, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D))
    outs = []
    for by_pages in (False, True):
        kc, vc = torch.randn(S, Hkv, D, generator=torch.Generator().manual_seed(0)), \
            torch.randn(S, Hkv, D, generator=torch.Generator().manual_seed(1))
        meta = build_attention_metadata(qsl, seq_lens, table, bs, slots, decode_by_pages=by_pages)
        outs.append(paged_attention(q, k, v, kc, vc, meta, D ** -0.5))
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)
