"""`pagedllm serve`, `run-batch` and `proxy` flags: command lines and the values they parse to,
written out by hand (each flag, its aliases and its environment default), and the values
refused at parse time."""

from __future__ import annotations

import pytest

from pagedllm.entrypoints.cli import build_parser

SERVE_DEFAULTS = {
    "model_tag": None,
    "host": "127.0.0.1",
    "port": 8000,
    "served_model_name": None,
    "api_key": None,
    "max_waiting_requests": 1024,
    "max_request_body_bytes": 8388608,
    "restart_engine_on_failure": False,
    "chat_template": None,
    "enable_auto_tool_choice": False,
    "tool_call_parser": None,
    "reasoning_parser": None,
    "serve_log_level": "info",
    "metrics_prefix": "pagedllm",
    "lora_modules": None,
    "allow_runtime_lora_updating": False,
    "log_stats_interval": 5.0,
}
RUN_BATCH_DEFAULTS = {
    "served_model_name": None,
    "chat_template": None,
    "enable_auto_tool_choice": False,
    "tool_call_parser": None,
    "reasoning_parser": None,
    "disable_progress_bar": False,
}
PROXY_DEFAULTS = {
    "host": "127.0.0.1",
    "port": 8000,
    "prefill": None,
    "decode": None,
    "launch_ray": None,
    "serve_args": "",
    "ttft_slo": None,
    "tbt_slo": None,
    "decode_max_num_seqs": 128,
    "trace": None,
}

CASES = [
    (["serve"], SERVE_DEFAULTS),
    (
        [
            "serve",
            "/models/m",
            "--host",
            "0.0.0.0",
            "--port",
            "9000",
            "--served-model-name",
            "a",
            "b",
            "--api-key",
            "k",
            "--max-waiting-requests",
            "0",
            "--max-request-body-bytes",
            "100",
            "--restart-engine-on-failure",
            "--chat-template",
            "t.jinja",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "qwen3_xml",
            "--reasoning-parser",
            "deepseek_r1",
            "--log-level",
            "debug",
            "--metrics-prefix",
            "vllm",
            "--lora-modules",
            "x=/a",
            "y=/b",
            "--allow-runtime-lora-updating",
            "--log-stats-interval",
            "0.5",
        ],
        {
            "model_tag": "/models/m",
            "host": "0.0.0.0",
            "port": 9000,
            "served_model_name": ["a", "b"],
            "api_key": "k",
            "max_waiting_requests": 0,
            "max_request_body_bytes": 100,
            "restart_engine_on_failure": True,
            "chat_template": "t.jinja",
            "enable_auto_tool_choice": True,
            "tool_call_parser": "qwen3_xml",
            "reasoning_parser": "deepseek_r1",
            "serve_log_level": "debug",
            "metrics_prefix": "vllm",
            "lora_modules": ["x=/a", "y=/b"],
            "allow_runtime_lora_updating": True,
            "log_stats_interval": 0.5,
        },
    ),
    (
        [
            "serve",
            "--port=8123",
            "--tool-call-parser",
            "hermes",
            "--reasoning-parser",
            "qwen3",
            "--log-level",
            "warning",
        ],
        {
            **SERVE_DEFAULTS,
            "port": 8123,
            "tool_call_parser": "hermes",
            "reasoning_parser": "qwen3",
            "serve_log_level": "warning",
        },
    ),
    (
        ["run-batch", "-i", "in.jsonl", "-o", "out.jsonl"],
        {**RUN_BATCH_DEFAULTS, "input_file": "in.jsonl", "output_file": "out.jsonl"},
    ),
    (
        [
            "run-batch",
            "--input-file",
            "in.jsonl",
            "--output-file",
            "out.jsonl",
            "--served-model-name",
            "m",
            "--chat-template",
            "t",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "pythonic",
            "--reasoning-parser",
            "qwen3",
            "--disable-progress-bar",
        ],
        {
            "input_file": "in.jsonl",
            "output_file": "out.jsonl",
            "served_model_name": ["m"],
            "chat_template": "t",
            "enable_auto_tool_choice": True,
            "tool_call_parser": "pythonic",
            "reasoning_parser": "qwen3",
            "disable_progress_bar": True,
        },
    ),
    (["proxy"], PROXY_DEFAULTS),
    (
        [
            "proxy",
            "--host",
            "0.0.0.0",
            "--port",
            "8100",
            "--prefill",
            "http://p1",
            "http://p2",
            "--decode",
            "http://d",
            "--ttft-slo",
            "0.5",
            "--tbt-slo",
            "0.05",
            "--decode-max-num-seqs",
            "64",
            "--trace",
            "/tmp/t.jsonl",
        ],
        {
            **PROXY_DEFAULTS,
            "host": "0.0.0.0",
            "port": 8100,
            "prefill": ["http://p1", "http://p2"],
            "decode": ["http://d"],
            "ttft_slo": 0.5,
            "tbt_slo": 0.05,
            "decode_max_num_seqs": 64,
            "trace": "/tmp/t.jsonl",
        },
    ),
    (
        ["proxy", "--launch-ray", '{"prefill": 1, "decode": 2}', "--serve-args", "--model M --max-num-seqs 8"],
        {**PROXY_DEFAULTS, "launch_ray": '{"prefill": 1, "decode": 2}', "serve_args": "--model M --max-num-seqs 8"},
    ),
]


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_API_KEY", raising=False)
    monkeypatch.delenv("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)


@pytest.mark.parametrize("argv, want", CASES, ids=lambda v: " ".join(v)[:60] if isinstance(v, list) else "")
def test_command_lines_parse_to_these_values(argv, want):
    ns = build_parser().parse_args(argv)
    assert {k: getattr(ns, k) for k in want} == want


def test_environment_defaults_are_read_when_the_parser_is_built(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_API_KEY", "from-env")
    monkeypatch.setenv("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    ns = build_parser().parse_args(["serve"])
    assert (ns.api_key, ns.allow_runtime_lora_updating) == ("from-env", True)
    assert build_parser().parse_args(["serve", "--api-key", "flag"]).api_key == "flag"


def test_the_serve_log_level_is_apart_from_the_commands():
    ns = build_parser().parse_args(["--log-level", "error", "serve", "--log-level", "debug"])
    assert (ns.log_level, ns.serve_log_level) == ("error", "debug")


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--max-request-body-bytes", "0"],
        ["serve", "--metrics-prefix", "a-b"],
        ["serve", "--port", "x"],
        ["serve", "--tool-call-parser", "nope"],
        ["serve", "--reasoning-parser", "nope"],
        ["serve", "--log-level", "loud"],
        ["run-batch", "-i", "a"],
        ["run-batch", "-i", "a", "-o", "b", "--tool-call-parser", "nope"],
        ["proxy", "--ttft-slo", "0"],
        ["proxy", "--tbt-slo", "-1"],
        ["proxy", "--decode-max-num-seqs", "0"],
    ],
)
def test_bad_values_are_argparse_errors(argv):
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)


def test_the_dataclasses_the_commands_run_with():
    from pagedllm.engine.cli_fields import dataclass_from_args
    from pagedllm.entrypoints.disagg_proxy.cli import ProxyArgs
    from pagedllm.entrypoints.openai.cli_args import FrontendArgs

    ns = build_parser().parse_args(["serve", "m", "--port", "9000", "--lora-modules", "x=/a"])
    assert dataclass_from_args(FrontendArgs, ns) == FrontendArgs(model_tag="m", port=9000, lora_modules=["x=/a"])
    ns = build_parser().parse_args(["proxy", "--prefill", "http://p", "--decode", "http://d", "--tbt-slo", "0.1"])
    assert dataclass_from_args(ProxyArgs, ns) == ProxyArgs(prefill=["http://p"], decode=["http://d"], tbt_slo=0.1)
    with pytest.raises(ValueError, match="--max-waiting-requests must be >= 0, got -1"):
        dataclass_from_args(FrontendArgs, build_parser().parse_args(["serve", "--max-waiting-requests", "-1"]))
