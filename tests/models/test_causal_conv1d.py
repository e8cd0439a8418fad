"""The causal conv1d with carried state against torch's own conv1d in float64 over the whole
sequence: chunked (chunks shorter and longer than the kernel), token by token, and several
requests packed in one call."""

import pytest
import torch
import torch.nn.functional as F

from pagedllm.models.layers.mamba.causal_conv1d import causal_conv1d

C, K = 6, 4


def reference(x, w, b):
    """x [T, C] float64 -> torch's depthwise conv1d, left-padded by K-1 zeros."""
    return F.conv1d(F.pad(x.T.unsqueeze(0), (K - 1, 0)), w.unsqueeze(1), b, groups=C)[0].T


@pytest.mark.parametrize("chunks", [[11], [2, 1, 5, 3], [1] * 11])
def test_chunks_carry_the_state(chunks):
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((sum(chunks), C), (C, K), (C,)))
    state = torch.zeros(1, C, K - 1, dtype=torch.float64)
    out, at = [], 0
    for n in chunks:
        out.append(causal_conv1d(x[at : at + n], w, b, state, torch.tensor([0, n])))
        at += n
    torch.testing.assert_close(torch.cat(out), reference(x, w, b))
    torch.testing.assert_close(state[0], x[-(K - 1) :].T)


@pytest.mark.parametrize("lens", [(5, 1, 2), (1, 1, 1)], ids=["mixed", "decodes"])
def test_packed_requests_each_with_its_state(lens):
    """Three requests of 5, 1 and 2 tokens (or one token each: a step of decodes), each after a
    first chunk of 3 tokens."""
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(C, K, generator=g, dtype=torch.float64), torch.randn(C, generator=g, dtype=torch.float64)
    seqs = [torch.randn(3 + n, C, generator=g, dtype=torch.float64) for n in lens]
    state = torch.zeros(3, C, K - 1, dtype=torch.float64)
    for r, s in enumerate(seqs):  # first chunks, one request a call
        causal_conv1d(s[:3], w, b, state[r : r + 1], torch.tensor([0, 3]))
    x = torch.cat([s[3:] for s in seqs])
    y = causal_conv1d(x, w, b, state, torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]))
    torch.testing.assert_close(y, torch.cat([reference(s, w, b)[3:] for s in seqs]))
    torch.testing.assert_close(state, torch.stack([s[-(K - 1) :].T for s in seqs]))


def test_bad_shapes():
    with pytest.raises(ValueError, match="state"):
        causal_conv1d(torch.zeros(2, C), torch.zeros(C, K), None, torch.zeros(1, C, K), torch.tensor([0, 2]))
