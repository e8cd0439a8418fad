"""The benchmarks' own arithmetic and plumbing (their figures live in BENCHMARKS.md, not here)."""

import json
import subprocess
import sys

import pytest
import torch

from pagedllm.benchmarks.common import Req
from pagedllm.benchmarks.roofline import model_flops, workload_flops
from pagedllm.profiler import PROFILER, summarize


def _hf_config(model_dir):
    with open(f"{model_dir}/config.json") as f:
        return json.load(f)


@pytest.mark.model
def test_linear_flops_match_the_model_parameters(model_dir):
    """2 FLOPs per weight of every linear layer but the LM head, counted on the real module."""
    from pagedllm.models.layers.linear import LinearBase
    from pagedllm.models.llama import LlamaForCausalLM

    hf = _hf_config(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(hf, max_positions=8)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, LinearBase))
    assert linear > 0
    f = model_flops(hf)
    assert f["linear"] == 2 * linear
    assert f["lm_head"] == 2 * model.lm_head.weight.numel()
    # QK^T and PV: 2 FLOPs x head_dim, for each head and layer, per key attended to.
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    assert f["attention_per_ctx"] == 2 * 2 * hf["num_attention_heads"] * head_dim * hf["num_hidden_layers"]


def test_workload_flops_by_hand():
    f = {"linear": 10.0, "attention_per_ctx": 1.0, "lm_head": 100.0}
    # 3 prompt + 2 output tokens: 4 tokens through the model at positions 0..3 (1+2+3+4 keys),
    # 2 sampled tokens.
    assert workload_flops(f, [Req([1, 2, 3], 2)]) == 4 * 10 + 10 + 2 * 100
    assert workload_flops(f, [Req([1], 1), Req([1], 1)]) == 2 * (10 + 1 + 100)


def test_profiler_charges_each_phase_and_skips_empty_steps():
    steps = [
        {"num_tokens": 1.0, "num_reqs": 1.0, "schedule": 0.001, "forward": 0.008, "sample": 0.001},
        {"num_tokens": 1.0, "num_reqs": 1.0, "schedule": 0.001, "forward": 0.008, "sample": 0.001},
    ]
    s = summarize(steps)
    assert s["steps"] == 2 and s["step_ms"] == pytest.approx(10.0)
    assert s["overhead_pct"] == pytest.approx(20.0)
    assert s["phases"]["forward"]["pct"] == pytest.approx(80.0)
    PROFILER.start()
    PROFILER.begin_step()
    PROFILER.mark("schedule")  # no tokens noted: an empty step is not recorded
    PROFILER.end_step()
    PROFILER.begin_step()
    PROFILER.note_batch(3, 2)
    PROFILER.mark("forward")
    PROFILER.end_step()
    got = PROFILER.stop()
    assert len(got) == 1 and got[0]["num_tokens"] == 3 and got[0]["forward"] >= 0
    PROFILER.begin_step()
    PROFILER.mark("forward")  # disabled: nothing recorded
    assert PROFILER.steps == got and len(PROFILER.steps) == 1


def test_bench_latency_profile_runs(tmp_path):
    """The real command, end to end, on a short run (a tiny random model: the profile's shape does
    not depend on the weights): every decode step is profiled and the phases add up to the step."""
    out = tmp_path / "lat.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedllm.entrypoints.cli",
            "bench",
            "latency",
            "--model",
            "random:tiny",
            "--batch-size",
            "1",
            "3",
            "--input-len",
            "8",
            "--output-len",
            "6",
            "--profile",
            "--torch-profile",
            "2",
            "--output-json",
            str(out),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    data = json.loads(out.read_text())
    rows = data["results"]
    tp = data["torch_profile"]  # torch.profiler over 2 decode steps: the ops by time
    assert tp["steps"] == 2 and "aten::" in tp["table"] and 0 < tp["device_us_per_step"]
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["output_tokens"] == 6 * r["batch"]
        prof = r["profile_decode"]
        assert prof["steps"] == 5 and prof["mean_reqs"] == r["batch"]
        assert sum(p["pct"] for p in prof["phases"].values()) == pytest.approx(100.0)
        assert 0 < prof["overhead_pct"] < 100


def test_bench_attention_bytes_and_rate(tmp_path):
    """`bench attention` counts the bytes a decode step's attention must move (all of K and V,
    the queries, the outputs, the block table) and divides by the kernel's time."""
    from kernel_utils import require_built

    from pagedllm.attention.backends.cpu_attn.kernels import decode_kernel
    from pagedllm.benchmarks.attention import decode_case

    require_built(decode_kernel())
    B, L, H, Hkv, D, bs = 3, 40, 8, 2, 64, 16
    fn, moved, _ = decode_case(torch, torch.device("cpu"), torch.float32, B, L, H, Hkv, D, bs)
    assert moved == 2 * B * L * Hkv * D * 4 + 2 * B * H * D * 4 + B * 3 * 4
    assert fn().shape == (B, H, D)
    # float32 queries over a bfloat16 cache (--kv-cache-dtype bfloat16): half the K/V bytes
    fn, moved, _ = decode_case(torch, torch.device("cpu"), torch.bfloat16, B, L, H, Hkv, D, bs, q_dtype=torch.float32)
    assert moved == 2 * B * L * Hkv * D * 2 + 2 * B * H * D * 4 + B * 3 * 4
    assert fn().dtype == torch.float32
    out = tmp_path / "attn.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedllm.entrypoints.cli",
            "bench",
            "attention",
            "--device",
            "cpu",
            "--batch-size",
            "2",
            "--context-len",
            "100",
            "--layers",
            "2",
            "--iters",
            "3",
            "--output-json",
            str(out),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    data = json.loads(out.read_text())
    assert data["kernel"] == "C++ paged_decode" and data["copy_gbps"] > 0 and data["layers"] == 2
    (row,) = data["results"]
    assert (row["batch"], row["context"]) == (2, 100)
    assert row["gbps"] == pytest.approx(row["kv_mib"] * 2**20 / (row["us"] * 1e-6) / 1e9)


def test_bench_spec_decode_runs(tmp_path):
    """`bench spec-decode` end to end on a tiny random model (no chat template: the prompts go in
    as plain text): every system on both workloads, the same greedy tokens as without
    speculation, drafts proposed and verified, a step profile for every system."""
    out = tmp_path / "sd.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedllm.entrypoints.cli",
            "bench",
            "spec-decode",
            "--model",
            "random:tiny",
            "--output-len",
            "12",
            "--profile",
            "--output-json",
            str(out),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {(r["system"], r["workload"]) for r in rows} == {
        (s, w)
        for s in ("no speculation", "ngram k=7 fixed", "ngram k<=7 adaptive")
        for w in ("repeating", "non-repeating")
    }
    assert all(r["same_tokens"] for r in rows)
    spec = [r for r in rows if r["system"] != "no speculation"]
    assert all(r["drafted"] > 0 and 0 <= r["acceptance"] <= 1 for r in spec)
    assert {s["system"] for s in data["steps"]} == {r["system"] for r in rows}  # --profile: every system


def test_bench_gguf_kernel_runs(tmp_path):
    """The real command on a small matrix: a row per type, ISA build, row count and activations
    (int8, int16), the held bytes the file's (Q4_0: its own 18 a block; Q4_K: 148 a block of 144)."""
    from pagedllm.csrc.build import runnable_isas

    out = tmp_path / "k.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedllm.entrypoints.cli",
            "bench",
            "gguf-kernel",
            "--types",
            "Q4_0",
            "Q4_K",
            "--shape",
            "48",
            "512",
            "--rows",
            "1",
            "9",
            "--seconds",
            "0.01",
            "--output-json",
            str(out),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=900,
    )
    rows = json.loads(out.read_text())["results"]
    assert [(r["type"], r["isa"], r["rows"], r["acts"]) for r in rows] == [
        (t, isa, n, a) for t in ("Q4_0", "Q4_K") for isa in runnable_isas() for n in (1, 9) for a in ("int8", "int16")
    ]
    for r in rows:
        assert r["held_mb"] == pytest.approx(r["file_mb"] * (148 / 144 if r["type"] == "Q4_K" else 1))
        assert r["gguf_ms"] > 0 and r["old_ms"] > 0


@pytest.mark.parametrize(
    "field, value", [("throughput", 0), ("image_fraction", 1.5), ("input_len", 0), ("random_range_ratio", 1.0)]
)
def test_bench_vision_throughput_bad_args(field, value):
    import argparse

    from pagedllm.benchmarks.vision_throughput import add_cli_args, check_args

    p = argparse.ArgumentParser()
    add_cli_args(p)
    ns = p.parse_args(["--throughput", "4"])
    setattr(ns, field, value)
    with pytest.raises(ValueError, match=f"{field} must be"):
        check_args(ns)
