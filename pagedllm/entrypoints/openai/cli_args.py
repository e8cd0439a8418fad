"""The `pagedllm serve` flags (named like vLLM's). No heavy imports here: the CLI builds every
subcommand's parser at start."""
from __future__ import annotations

import argparse

from pagedllm import envs

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None,
                   help="model directory (same as --model); default: SmolLM2-135M-Instruct")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the name(s) clients give as `model` (default: the model as given)")
    p.add_argument("--api-key", default=envs.PAGEDLLM_API_KEY,
                   help="require 'Authorization: Bearer KEY' on /v1, /tokenize, /detokenize "
                        "(default: $PAGEDLLM_API_KEY, else none)")
    p.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="refuse with 503 a request that would make more than this many wait (default 1024)")
    p.add_argument("--max-request-body-bytes", type=_positive_int,
                   default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="refuse with 413 a request body larger than this, before reading it whole "
                        "(default 8388608 = 8 MiB)")
    p.add_argument("--restart-engine-on-failure", action="store_true",
                   help="when the engine core process dies, start a new one (the requests in flight get "
                        "503) instead of exiting 1 for a supervisor to restart the server")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one")
    # Names known here without importing the parsers (the CLI builds every parser at start).
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide to call tools (tool_choice "auto"); needs --tool-call-parser')
    p.add_argument("--tool-call-parser", default=None,
                   choices=["hermes", "llama3_json", "mistral", "pythonic", "qwen3_xml"],
                   help="how the model writes tool calls: hermes (<tool_call>{json}</tool_call>), "
                        "llama3_json ({\"name\", \"parameters\"}), mistral ([TOOL_CALLS]...), pythonic "
                        "([f(a=1)]) or qwen3_xml (Qwen3-Coder's <function=f><parameter=a>)")
    p.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="split <think>...</think> off the answer into reasoning_content")
    p.add_argument("--log-level", dest="serve_log_level", default="info",
                   choices=["debug", "info", "warning", "error", "critical"])
    p.add_argument("--metrics-prefix", type=_metrics_prefix, default="pagedllm",
                   help="the namespace of the /metrics series (default pagedllm); 'vllm' gives the names "
                        "vLLM's Grafana dashboards query (vllm:num_requests_running, ...)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) served under NAME, the request's `model` "
                        "(needs --enable-lora)")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   default=envs.PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING,
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                        "(default: $PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING, else off)")
    p.add_argument("--log-stats-interval", type=float, default=5.0,
                   help="seconds between stats lines while busy (default 5)")


def _metrics_prefix(value: str) -> str:
    import re
    if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", value):
        raise argparse.ArgumentTypeError(f"must be a Prometheus name ([a-zA-Z_][a-zA-Z0-9_]*), got {value!r}")
    return value


def _positive_int(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return n
