"""`bench prefill-attention`: both of its calls compute the same attention, its FLOP count is the
causal pairs' (hand-counted), and bad head shapes are refused."""

import pytest
import torch
from kernel_utils import require_built

from pagedllm.attention.backends.cpu_attn.kernels import prefill_kernel
from pagedllm.benchmarks.prefill_attention import parse_heads, prefill_case


def test_prefill_case_calls_agree_and_flops_count_causal_pairs():
    require_built(prefill_kernel(torch.float32, 64))
    calls, flops = prefill_case(torch, torch.float32, 5, 3, 4, 2, 64, 4)
    # query i (0..4) at position 3 + i sees 4 + i keys: 4 + 5 + 6 + 7 + 8 = 30 pairs
    assert flops == 4 * 4 * 64 * 30
    sdpa, kernel = calls["sdpa"](), calls["kernel"]()
    assert sdpa.shape == (5, 4, 64)
    torch.testing.assert_close(kernel, sdpa, atol=2e-5, rtol=2e-5)


def test_parse_heads_refuses_bad_shapes():
    assert parse_heads("9/3") == (9, 3)
    for bad in ("9", "9/4", "0/1", "a/b"):
        with pytest.raises(ValueError, match="--heads"):
            parse_heads(bad)
