"""`bench latency --llama-cpp FILE.gguf`: the command lines given to llama.cpp's tools, the
parsing of what they print (samples in their real formats, values written by hand), and one
real run on a tiny file from `pagedllm make-gguf` where the tools are built."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys

import pytest

from pagedllm.benchmarks.llama_cpp_compare import (
    batched_bench_command,
    llama_bench_command,
    parse_batched_bench,
    parse_llama_bench,
)
from pagedllm.benchmarks.llama_cpp_tools import find_tool, missing_tools, tool_path
from pagedllm.benchmarks.latency import split_llama_cpp

# llama-bench -o json: one object per test, pp (n_gen 0) and tg (n_prompt 0); fields trimmed
LLAMA_BENCH_JSON = """[
  {"build_commit": "0c1e570", "cpu_info": "AMD EPYC", "model_type": "llama 1B Q4_0", "model_size": 630000000,
   "model_n_params": 1235814400, "n_threads": 2, "n_prompt": 128, "n_gen": 0, "avg_ns": 2000000000,
   "avg_ts": 64.000000, "stddev_ts": 1.5, "samples_ts": [ 62.5, 65.5 ]},
  {"build_commit": "0c1e570", "cpu_info": "AMD EPYC", "model_type": "llama 1B Q4_0", "model_size": 630000000,
   "model_n_params": 1235814400, "n_threads": 2, "n_prompt": 512, "n_gen": 0, "avg_ns": 10000000000,
   "avg_ts": 51.200000, "stddev_ts": 0.2, "samples_ts": [ 51.0, 51.4 ]},
  {"build_commit": "0c1e570", "cpu_info": "AMD EPYC", "model_type": "llama 1B Q4_0", "model_size": 630000000,
   "model_n_params": 1235814400, "n_threads": 2, "n_prompt": 0, "n_gen": 32, "avg_ns": 800000000,
   "avg_ts": 40.000000, "stddev_ts": 0.5, "samples_ts": [ 39.5, 40.5 ]}
]
"""
# llama-batched-bench --output-format jsonl: one line per (pp, tg, pl), other lines around it
BATCHED_JSONL = (
    "\n"
    '{"n_kv_max": 2560, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, '
    '"n_threads": 2, "n_threads_batch": 2, "pp": 128, "tg": 32, "pl": 16, "n_kv": 2560, "t_pp": 32.000000, '
    '"speed_pp": 64.000000, "t_tg": 5.120000, "speed_tg": 100.000000, "t": 37.120000, "speed": 68.965515}\n'
    "\n"
)


def test_llama_bench_output_parsed():
    got = parse_llama_bench(LLAMA_BENCH_JSON)
    assert got == {
        "prefill": {128: 64.0, 512: 51.2},
        "decode": 40.0,
        "decode_n": 32,
        "model_bytes": 630000000,
        "threads": 2,
    }


def test_batched_bench_output_parsed():
    assert parse_batched_bench(BATCHED_JSONL, 16) == {"decode": 100.0, "prefill": 64.0}
    with pytest.raises(ValueError, match="no result for 8 sequences"):
        parse_batched_bench(BATCHED_JSONL, 8)


def test_unparsable_outputs_refused():
    with pytest.raises(ValueError, match="not its JSON"):
        parse_llama_bench("error: failed to load model\n")
    only_pp = json.dumps([json.loads(LLAMA_BENCH_JSON)[0]])
    with pytest.raises(ValueError, match="lacks a prefill .pp. or a decode .tg."):
        parse_llama_bench(only_pp)


def test_tool_command_lines():
    assert llama_bench_command("/b/llama-bench", "m.gguf", 2, [128, 512], 32, 3) == [
        "/b/llama-bench",
        "-m",
        "m.gguf",
        "-t",
        "2",
        "-p",
        "128,512",
        "-n",
        "32",
        "-r",
        "3",
        "-o",
        "json",
    ]
    # 16 sequences of 128 + 32 tokens: a KV cache of 2560 cells
    assert batched_bench_command("/b/llama-batched-bench", "m.gguf", 1, 128, 32, 16) == [
        "/b/llama-batched-bench",
        "-m",
        "m.gguf",
        "-t",
        "1",
        "-npp",
        "128",
        "-ntg",
        "32",
        "-npl",
        "16",
        "-c",
        "2560",
        "--output-format",
        "jsonl",
    ]


def test_llama_cpp_values_split_into_files_and_precisions(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert split_llama_cpp(["f32", str(f), "q4_1"]) == ([str(f)], ["f32", "q4_1"])
    with pytest.raises(ValueError, match="does not exist"):
        split_llama_cpp([str(tmp_path / "absent.gguf")])
    with pytest.raises(ValueError, match="a .gguf file or one of f32, bf16, q4_1"):
        split_llama_cpp(["q8_0"])


def test_missing_tool_says_how_to_build(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_HOME", str(tmp_path))
    assert tool_path("llama-bench") == tmp_path / "llama.cpp-0.3.36" / "build" / "bin" / "llama-bench"
    with pytest.raises(RuntimeError, match="make llama-cpp"):
        find_tool("llama-bench")
    with pytest.raises(ValueError, match="llama.cpp tool must be one of"):
        tool_path("llama-cli")


NEEDED = ("llama-bench", "llama-batched-bench")


@pytest.mark.skipif(
    bool(missing_tools(NEEDED)),
    reason=f"llama.cpp's tools are not built on this machine (missing {', '.join(missing_tools(NEEDED))} "
    f"under {tool_path('llama-bench').parent}); `make llama-cpp` builds them (~15 min on 2 "
    "cores), which CI does not do",
)
def test_batched_bench_run_again_when_its_log_is_lost(tmp_path):
    """llama-batched-bench's logger thread can drop its table at exit (exit 0, empty stdout):
    the run is repeated; a tool that never prints is still refused, naming the tool."""
    from pagedllm.benchmarks.llama_cpp_compare import run_batched_bench

    row = '{"pp": 16, "tg": 4, "pl": 4, "speed_pp": 100.0, "speed_tg": 40.0}'
    tool = tmp_path / "flaky-bench"
    count = tmp_path / "runs"
    # prints nothing on its first three runs (as seen under a parallel test run), then the table
    tool.write_text(f"#!/bin/sh\necho x >> {count}\n[ $(wc -l < {count}) -gt 3 ] && echo '{row}'\nexit 0\n")
    tool.chmod(0o755)
    assert run_batched_bench([str(tool)], 4) == {"decode": 40.0, "prefill": 100.0}
    assert count.read_text().count("x") == 4
    silent = tmp_path / "silent-bench"
    silent.write_text("#!/bin/sh\nexit 0\n")
    silent.chmod(0o755)
    with pytest.raises(ValueError, match="llama-batched-bench printed no result for 4 sequences"):
        run_batched_bench([str(silent)], 4)


def test_real_run_on_a_made_file(tmp_path):
    """`pagedllm make-gguf` writes a tiny Q8_0 file; the bench runs llama.cpp's tools and the
    engine on it, two interleaved turns: every figure of both sides is there and positive, each the
    median of its turns, and llama.cpp's weight bytes are the file's tensor bytes as the gguf
    package reads them."""
    from gguf import GGUFReader

    path, out = tmp_path / "tiny.Q8_0.gguf", tmp_path / "cmp.json"
    cli = [sys.executable, "-m", "pagedllm.entrypoints.cli"]
    subprocess.run(
        [*cli, "make-gguf", "--shape", "tiny", "--type", "Q8_0", "--out", str(path)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    run = subprocess.run(
        [
            *cli,
            "bench",
            "latency",
            "--model",
            str(path),
            "--llama-cpp",
            str(path),
            "--threads",
            "1",
            "--output-len",
            "4",
            "--llama-cpp-prefill",
            "16",
            "32",
            "--llama-cpp-batch",
            "4",
            "--llama-cpp-repetitions",
            "1",
            "--max-model-len",
            "64",
            "--repeat",
            "2",
            "--output-json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["against_llama_cpp"][str(path)]
    assert [r["figure"] for r in rows] == [
        "batch-1 decode tok/s (tg4)",
        "prefill 16 tok/s (pp16)",
        "prefill 32 tok/s (pp32)",
        "batch-4 decode tok/s",
        "weights held MB",
        rows[-1]["figure"],
    ]
    assert re.fullmatch(r"batch-1 weights read GB/s \(machine: \d+\.\d\)", rows[-1]["figure"])
    assert all(r["threads"] == 1 and r["llama.cpp"] > 0 and r["pagedllm"] > 0 for r in rows)
    tensor_mb = sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors) / 1e6
    assert rows[-2]["llama.cpp"] == pytest.approx(tensor_mb, rel=1e-6)
    # two interleaved turns: each figure their median, the ratio the median of the turns' ratios
    for r in rows:
        assert len(r["pairs"]) == 2 and all(len(v) == 2 for v in r["runs"].values())
        for side in ("llama.cpp", "pagedllm"):
            assert r[side] == pytest.approx(statistics.median(r["runs"][side]), rel=1e-12)
        turns = [o / t for t, o in zip(r["runs"]["llama.cpp"], r["runs"]["pagedllm"])]
        assert r["pairs"] == pytest.approx(turns, rel=1e-12)
        assert r["ratio"] == pytest.approx(statistics.median(turns), rel=1e-12)
    # the read rate: each side's batch-1 tok/s times its weights, a turn
    for side in ("llama.cpp", "pagedllm"):
        for i in range(2):
            decode, weights = rows[0]["runs"][side][i], rows[-2]["runs"][side][i]
            assert rows[-1]["runs"][side][i] == pytest.approx(decode * weights / 1e3, rel=1e-9)
    assert "pagedllm / llama.cpp" in run.stdout and "weights held MB" in run.stdout
    assert "each turn's ratio" in run.stdout
