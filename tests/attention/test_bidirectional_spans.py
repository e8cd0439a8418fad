"""Token spans that attend to each other both ways (an image's tokens in Gemma 3): the torch
backend (SDPA over gathered slots) and the CPU backend (the C++ prefill kernel for the other
chunks, masked SDPA for these) against a float64 reference with transformers' block mask,
OR(causal, same span) AND the sliding window, in a step mixing such chunks (from the start, and
over a past that holds the span's first tokens) with a decode and a plain prefill."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from kernel_utils import require_built

from pagedllm.attention.backends.cpu_attn import CPUAttentionBackend
from pagedllm.attention.backends.cpu_attn import kernels as cpu_kernels
from pagedllm.attention.backends.torch_sdpa import TorchSDPABackend

BS, H, HKV, D = 4, 4, 2, 16
# (tokens before the step, tokens in it, spans in sequence positions)
ROWS = [(0, 12, [(3, 9)]), (7, 1, []), (6, 8, [(4, 12), (12, 14)]), (0, 5, [])]
SPANS = {r: spans for r, (_, _, spans) in enumerate(ROWS) if spans}


def _reference(q, k_all, v_all, c, n, spans, window, scale):
    """q [n, H, D], k/v_all [c + n, HKV, D] -> [n, H, D] in float64."""
    qpos, kpos = np.arange(c, c + n)[:, None], np.arange(c + n)[None, :]
    mask = kpos <= qpos
    for lo, hi in spans:
        mask |= (qpos >= lo) & (qpos < hi) & (kpos >= lo) & (kpos < hi)
    if window:
        mask &= kpos > qpos - window
    kk = k_all.double().repeat_interleave(H // HKV, 1)  # [L, H, D]
    vv = v_all.double().repeat_interleave(H // HKV, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    s = s.masked_fill(~torch.from_numpy(mask), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)


@pytest.mark.usefixtures("cpu_isa")  # every build of the kernels this CPU runs
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("backend_cls", [TorchSDPABackend, CPUAttentionBackend])
def test_spans_attend_both_ways(backend_cls, window):
    if backend_cls is CPUAttentionBackend:
        require_built(cpu_kernels.prefill_kernel(torch.float32, D))
    torch.manual_seed(0)
    max_blocks = 4
    seq_lens = np.array([c + n for c, n, _ in ROWS], dtype=np.int32)
    qsl = np.r_[0, np.cumsum([n for _, n, _ in ROWS])].astype(np.int32)
    table = np.arange(1, 1 + len(ROWS) * max_blocks, dtype=np.int32).reshape(len(ROWS), max_blocks)
    slots_of = [
        table[r, np.arange(c + n) // BS].astype(np.int64) * BS + np.arange(c + n) % BS
        for r, (c, n, _) in enumerate(ROWS)
    ]
    S = (1 + len(ROWS) * max_blocks) * BS
    k_cache, v_cache = torch.zeros(S, HKV, D), torch.zeros(S, HKV, D)
    k_all = [torch.randn(c + n, HKV, D) for c, n, _ in ROWS]
    v_all = [torch.randn(c + n, HKV, D) for c, n, _ in ROWS]
    for r, (c, _, _) in enumerate(ROWS):  # the past in the cache
        k_cache[slots_of[r][:c]], v_cache[slots_of[r][:c]] = k_all[r][:c], v_all[r][:c]
    k = torch.cat([k_all[r][c:] for r, (c, _, _) in enumerate(ROWS)])
    v = torch.cat([v_all[r][c:] for r, (c, _, _) in enumerate(ROWS)])
    q = torch.randn(int(qsl[-1]), H, D)
    slot_mapping = torch.from_numpy(np.concatenate([slots_of[r][c:] for r, (c, _, _) in enumerate(ROWS)]))
    backend = backend_cls("cpu")
    meta = backend.build_metadata(
        torch.from_numpy(qsl),
        torch.from_numpy(seq_lens),
        torch.from_numpy(table),
        slot_mapping,
        BS,
        bidirectional=SPANS,
    )
    layer = SimpleNamespace(sliding_window=window, scale=D**-0.5)
    out = backend.forward(layer, q, k, v, (k_cache, v_cache), meta)
    for r, (c, n, spans) in enumerate(ROWS):
        ref = _reference(q[qsl[r] : qsl[r + 1]], k_all[r], v_all[r], c, n, spans, window, layer.scale)
        torch.testing.assert_close(out[qsl[r] : qsl[r + 1]].double(), ref, atol=1e-5, rtol=1e-5)


def test_spans_make_a_difference():
    """Without the spans the same step gives other outputs for the spans' tokens (the test above
    would catch their loss)."""
    torch.manual_seed(0)
    q, kv = torch.randn(12, H, D), torch.randn(12, HKV, D)
    ref = _reference(q, kv, kv, 0, 12, [(3, 9)], None, D**-0.5)
    causal = _reference(q, kv, kv, 0, 12, [], None, D**-0.5)
    assert not torch.allclose(ref[3:8], causal[3:8]) and torch.allclose(ref[8:], causal[8:])
