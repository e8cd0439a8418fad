"""Mamba2's selective scan against its recurrence written out token by token in float64:
the chunked prefill (chunks shorter than, equal to and across the prompt, continued from a
carried state) and the batched one-token decode."""

import pytest
import torch

from pagedllm.models.layers.mamba.ssd import ssd_chunk_scan, ssd_decode_step

H, P, G, N = 4, 3, 2, 5


def inputs(T, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    dt = torch.nn.functional.softplus(r(T, H))
    A = -torch.rand(H, generator=g, dtype=torch.float64) * 2
    return r(T, H, P), dt, A, r(T, G, N), r(T, G, N), r(H)


def recurrence(x, dt, A, B, C, D, state):
    """The definition, one token and one head at a time (head h reads group h // (H // G))."""
    state, ys = state.clone(), []
    for t in range(x.shape[0]):
        y = torch.empty(H, P, dtype=torch.float64)
        for h in range(H):
            g = h // (H // G)
            state[h] = torch.exp(dt[t, h] * A[h]) * state[h] + dt[t, h] * torch.outer(x[t, h], B[t, g])
            y[h] = state[h] @ C[t, g] + D[h] * x[t, h]
        ys.append(y)
    return torch.stack(ys), state


@pytest.mark.parametrize("chunk_size,splits", [(4, [10]), (16, [10]), (3, [4, 1, 5])])
def test_chunked_prefill_equals_the_recurrence(chunk_size, splits):
    x, dt, A, B, C, D = inputs(sum(splits), 0)
    start = torch.randn(H, P, N, dtype=torch.float64)
    want_y, want_state = recurrence(x, dt, A, B, C, D, start)
    state, ys, at = start.clone(), [], 0
    for n in splits:  # a request's prefill chunks, the state carried between them
        ys.append(
            ssd_chunk_scan(x[at : at + n], dt[at : at + n], A, B[at : at + n], C[at : at + n], D, state, chunk_size)
        )
        at += n
    torch.testing.assert_close(torch.cat(ys), want_y)
    torch.testing.assert_close(state, want_state)


def test_decode_step_of_several_requests():
    R = 3
    x, dt, A, B, C, D = inputs(R, 1)
    start = torch.randn(R, H, P, N, dtype=torch.float64)
    state = start.clone()
    y = ssd_decode_step(x, dt, A, B, C, D, state)
    for r in range(R):
        want_y, want_state = recurrence(x[r : r + 1], dt[r : r + 1], A, B[r : r + 1], C[r : r + 1], D, start[r])
        torch.testing.assert_close(y[r], want_y[0])
        torch.testing.assert_close(state[r], want_state)
