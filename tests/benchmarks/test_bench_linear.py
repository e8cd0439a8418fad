"""`pagedllm bench linear`: it runs each kernel at each row count and thread count, its rates
follow from its times and the shapes by hand, and bad flags are refused by name."""

import argparse
import json
import subprocess
import sys

import pytest
import torch

from pagedllm.benchmarks.linear import check_args
from pagedllm.models.layers.cpu_packed_linear import packed_linear_supported


def test_linear_bench_end_to_end(tmp_path):
    out = tmp_path / "b.json"
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "linear", "--shapes", "64", "32", "16", "64"]
    cmd += ["--rows", "1", "16", "--threads", "1", "--copies", "2", "--passes", "2", "--output-json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    # linear_small only up to 8 rows; the pair kernel and oneDNN's packed linear (F.linear where
    # oneDNN has no bfloat16 kernels) at every row count.
    base = "oneDNN packed" if packed_linear_supported(torch.bfloat16) else "F.linear"
    assert [(x["rows"], x["kernel"]) for x in rows] == [
        (1, "linear_small"),
        (1, "bf16_pair_linear"),
        (1, base),
        (16, "bf16_pair_linear"),
        (16, base),
    ]
    for x in rows:  # (64*32 + 16*64) weights of 2 bytes, 2 FLOP per weight and row
        assert x["gb_s"] == pytest.approx((64 * 32 + 16 * 64) * 2 / (x["ms"] / 1e3) / 1e9)
        assert x["gflop_s"] == pytest.approx(2 * x["rows"] * (64 * 32 + 16 * 64) / (x["ms"] / 1e3) / 1e9)
    assert "linear_small" in r.stdout and f"{base}'s rate" in r.stdout


def _ns(**over):
    base = dict(shapes=[8, 4], rows=[1], threads=None, copies=1, passes=1)
    return argparse.Namespace(**{**base, **over})


@pytest.mark.parametrize(
    "over, field",
    [
        ({"shapes": [8, 4, 2]}, "shapes must be N K pairs"),
        ({"shapes": [8, 0]}, "shapes"),
        ({"rows": [0]}, "rows"),
        ({"threads": [0]}, "threads"),
        ({"copies": 0}, "copies"),
        ({"passes": 0}, "passes"),
    ],
)
def test_bad_flags_name_the_field(over, field):
    with pytest.raises(ValueError, match=field):
        check_args(_ns(**over))
    assert check_args(_ns()) == [(8, 4)]
