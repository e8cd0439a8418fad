"""`bench serve --against vllm`: the tool's own logic with no vLLM installed (a real run installs
GBs and is the benchmark itself, BENCHMARKS.md): both servers get the same engine settings, the
medians and ratios by hand, the flags refused; and the pagedllm half for real: its server command
started on 127.0.0.1, waited for, loaded by the same code path, stopped with its engine core."""

import argparse
import subprocess
import sys

import pytest

from pagedllm.benchmarks.against.serve import check_args, compare, median_rows, print_comparison, server_commands
from pagedllm.benchmarks.load import measure, request_bodies
from pagedllm.entrypoints.server_process import ServerProcess, free_port
from server_utils import wait_session_gone


def _ns(**over):
    base = dict(
        repeat=1,
        concurrency=[16, 64],
        max_num_seqs=None,
        max_num_batched_tokens=2048,
        max_model_len=4096,
        kv_cache_memory=4,
        dtype="bfloat16",
        offline=False,
        long_every=0,
        api_key=None,
        num_prompts=4,
        random_input_len=8,
        random_output_len=4,
        random_range_ratio=0.0,
        long_input_len=2048,
        warmup=1,
        request_rate=float("inf"),
        seed=0,
    )
    return argparse.Namespace(**{**base, **over})


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_both_servers_get_the_same_engine_settings():
    cmds = server_commands(_ns(), "/models/m", 1234, "/venv/bin/python")
    p, v = cmds["pagedllm"], cmds["vllm"]
    assert p[1:4] == ["-m", "pagedllm.entrypoints.cli", "serve"]
    assert v[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    for flag, want in (
        ("--model", "/models/m"),
        ("--port", "1234"),
        ("--host", "127.0.0.1"),
        ("--dtype", "bfloat16"),
        ("--max-num-seqs", "64"),
        ("--max-num-batched-tokens", "2048"),
        ("--max-model-len", "4096"),
    ):
        assert _flag(p, flag) == want and _flag(v, flag) == want, flag
    assert "--no-enable-prefix-caching" in p and "--no-enable-prefix-caching" in v
    assert _flag(p, "--kv-cache-memory") == "4"  # vLLM's: VLLM_CPU_KVCACHE_SPACE (vllm_env)


def _row(rate, ttft, failed=0):
    return {
        "output_throughput": rate,
        "p50_ttft_ms": ttft,
        "p50_tpot_ms": 10.0,
        "p50_itl_ms": 10.0,
        "p99_itl_ms": 30.0,
        "failed": failed,
        "rejected": 0,
    }


def test_medians_and_ratios_by_hand(capsys):
    m = median_rows([_row(100, 5), _row(80, 7), _row(120, 6, failed=1)])
    assert m["output_throughput"] == 100 and m["p50_ttft_ms"] == 6
    assert m["spread_pct"] == pytest.approx(40.0) and m["failed"] == 1
    table = compare({"pagedllm": {16: [_row(120, 3)]}, "vllm": {16: [_row(100, 4)]}})
    ratio = [r for r in table if r["system"] == "pagedllm / vLLM"][0]
    assert ratio["output_throughput"] == pytest.approx(1.2) and ratio["p50_ttft_ms"] == pytest.approx(0.75)
    assert ratio["p50_tpot_ms"] == pytest.approx(1.0)
    print_comparison(table)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines[3:6]] == ["pagedllm", "vllm", "pagedllm"]
    assert lines[5].split()[2:5] == ["/", "vLLM", "1.20"]


@pytest.mark.parametrize(
    "over, field",
    [
        ({"repeat": 0}, "repeat"),
        ({"max_num_seqs": 8}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"kv_cache_memory": 0}, "kv_cache_memory"),
        ({"offline": True}, "--offline"),
        ({"long_every": 4}, "--long-every"),
    ],
)
def test_bad_flags_name_the_field(over, field):
    with pytest.raises(ValueError, match=field):
        check_args(_ns(**over))
    check_args(_ns())


def test_cli_refuses_bad_flags_before_installing_anything(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedllm.entrypoints.cli",
            "bench",
            "serve",
            "--against",
            "vllm",
            "--concurrency",
            "16",
            "--max-num-seqs",
            "4",
            "--vllm-venv",
            str(tmp_path / "venv"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "max_num_seqs" in done.stderr
    assert not (tmp_path / "venv").exists()


@pytest.mark.timeout(300)
def test_pagedllm_server_started_loaded_and_stopped():
    from transformers import AutoTokenizer
    from pagedllm.models.download import resolve_model

    model_dir = str(resolve_model("random:tiny"))
    ns = _ns(concurrency=[2], dtype="float32", max_model_len=256, max_num_batched_tokens=64)
    port = free_port()
    server = ServerProcess(
        server_commands(ns, model_dir, port, "unused")["pagedllm"], f"http://127.0.0.1:{port}", name="pagedllm"
    )
    try:
        server.wait_ready(240)
        bodies = request_bodies(AutoTokenizer.from_pretrained(model_dir), ns, model_dir, seed=0)
        import httpx

        served = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        row = measure(ns, server.url, {}, [{**b, "model": served} for b in bodies], 2)
        assert row["completed"] == 4 and row["failed"] == 0 and row["output_tokens"] == 4 * 4
        assert row["input_tokens"] == 4 * 8
    finally:
        code = server.stop()
    assert code is not None
    wait_session_gone(server, 30)  # the session (the server and its engine core) goes, SIGKILLed at the latest
