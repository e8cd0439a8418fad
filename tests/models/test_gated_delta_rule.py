"""The gated delta rule against its recurrence written out token by token in float64 and against
transformers' own torch implementations (Qwen3-Next's): the chunked prefill (chunks shorter than,
equal to and across the prompt, continued from a carried state, bf16 inputs) and the batched
one-token decode."""

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from pagedllm.models.layers.mamba.gated_delta_rule import chunk_gated_delta_rule, gated_delta_rule_step

H, DK, DV = 3, 8, 6


def inputs(T, seed, n=None):
    """q, k (unit rows, as the models normalise them), v, g (log decay <= 0), beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (T, H) if n is None else (n, H)
    r = lambda *s: torch.randn(*shape, *s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = (torch.nn.functional.normalize(r(DK), dim=-1) for _ in range(2))
    g = -torch.nn.functional.softplus(r()) * 0.5
    return q, k, r(DV), g, torch.sigmoid(r()), torch.randn(H, DK, DV, generator=gen, dtype=torch.float64)


def recurrence(q, k, v, g, beta, state, scale=DK**-0.5):
    """The definition, one token and one head at a time."""
    state, out = state.clone(), torch.empty(q.shape[0], H, DV, dtype=torch.float64)
    for t in range(q.shape[0]):
        for h in range(H):
            state[h] = torch.exp(g[t, h]) * state[h]
            state[h] += beta[t, h] * torch.outer(k[t, h], v[t, h] - state[h].T @ k[t, h])
            out[t, h] = state[h].T @ (scale * q[t, h])
    return out, state


@pytest.mark.parametrize("T,chunk", [(1, 64), (5, 64), (16, 16), (37, 16), (130, 64)])
def test_chunked_prefill_equals_the_recurrence(T, chunk):
    q, k, v, g, beta, s0 = inputs(T, seed=T)
    want, want_state = recurrence(q, k, v, g, beta, s0)
    state = s0.float()
    got = chunk_gated_delta_rule(*(t.float() for t in (q, k, v, g, beta)), state, chunk_size=chunk)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(state.double(), want_state, atol=1e-5, rtol=1e-4)


def test_prefill_continues_from_the_carried_state():
    """Two calls (the prompt split as a token budget would) = one call over the whole prompt."""
    q, k, v, g, beta, s0 = (t.float() for t in inputs(50, seed=3))
    whole_state, split_state = s0.clone(), s0.clone()
    whole = chunk_gated_delta_rule(q, k, v, g, beta, whole_state, chunk_size=16)
    first = chunk_gated_delta_rule(q[:21], k[:21], v[:21], g[:21], beta[:21], split_state, chunk_size=16)
    rest = chunk_gated_delta_rule(q[21:], k[21:], v[21:], g[21:], beta[21:], split_state, chunk_size=16)
    torch.testing.assert_close(torch.cat([first, rest]), whole, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(split_state, whole_state, atol=1e-5, rtol=1e-4)


def test_strong_decay_stays_finite():
    """g of -30 a token: the chunk's cumulative decay underflows to 0, never overflows."""
    q, k, v, g, beta, s0 = inputs(64, seed=5)
    g = torch.full_like(g, -30.0)
    want, want_state = recurrence(q, k, v, g, beta, s0)
    state = s0.float()
    got = chunk_gated_delta_rule(*(t.float() for t in (q, k, v, g, beta)), state)
    assert torch.isfinite(got).all() and torch.isfinite(state).all()
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)


def test_bf16_inputs_into_a_float32_state():
    q, k, v, g, beta, s0 = inputs(40, seed=9)
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    want, want_state = recurrence(*(t.double() for t in (qb, kb, vb)), g, beta, s0)
    state = s0.float()
    got = chunk_gated_delta_rule(qb, kb, vb, g.float(), beta.float(), state, chunk_size=16)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(state.double(), want_state, atol=1e-4, rtol=1e-3)


def test_decode_step_of_several_requests():
    """N requests, one token each, every request its own state row."""
    n = 4
    q, k, v, g, beta, _ = inputs(0, seed=11, n=n)
    states = torch.randn(n, H, DK, DV, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    want = [
        recurrence(q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1], beta[i : i + 1], states[i]) for i in range(n)
    ]
    cache = states.float()
    got = gated_delta_rule_step(*(t.float() for t in (q, k, v, g, beta)), cache)
    torch.testing.assert_close(got.double(), torch.cat([o for o, _ in want]), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(cache.double(), torch.stack([s for _, s in want]), atol=1e-5, rtol=1e-4)


def test_decode_into_a_bf16_state_row_writes_it_back():
    q, k, v, g, beta, _ = (t.float() for t in inputs(0, seed=13, n=2))
    states = torch.randn(2, H, DK, DV, generator=torch.Generator().manual_seed(14))
    cache = states.to(torch.bfloat16)
    want_cache = cache.float()
    want = gated_delta_rule_step(q, k, v, g, beta, want_cache)
    got = gated_delta_rule_step(q, k, v, g, beta, cache)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(cache.float(), want_cache.to(torch.bfloat16).float())


@pytest.mark.parametrize("T", [7, 100])
def test_equals_transformers_torch_implementations(T):
    """Qwen3-Next's torch fallbacks in transformers ([batch, T, heads, dim] layout) on the same
    inputs: the chunked one for prefill, the recurrent one for a decode token."""
    q, k, v, g, beta, s0 = (t.float() for t in inputs(T, seed=T + 1))
    ref, ref_state = torch_chunk_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        g[None],
        beta[None],
        chunk_size=64,
        initial_state=s0[None].clone(),
        output_final_state=True,
    )
    state = s0.clone()
    got = chunk_gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(got, ref[0].float(), atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(state, ref_state[0].float(), atol=1e-4, rtol=1e-3)
    q1, k1, v1, g1, b1, _ = (t.float() for t in inputs(1, seed=T + 2))
    ref1, ref1_state = torch_recurrent_gated_delta_rule(
        q1[None], k1[None], v1[None], g1[None], b1[None], initial_state=state[None].clone(), output_final_state=True
    )
    got1 = gated_delta_rule_step(q1, k1, v1, g1, b1, state[None])
    torch.testing.assert_close(got1, ref1[0].float(), atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(state, ref1_state[0].float(), atol=1e-4, rtol=1e-3)
