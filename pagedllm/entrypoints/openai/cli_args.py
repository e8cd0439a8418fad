"""The `pagedllm serve` flags (named like vLLM's), generated from FrontendArgs' fields as the
engine's are from EngineArgs' (engine/cli_fields.py): a new server flag is one field here. No
heavy imports: the CLI builds every subcommand's parser at start."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Optional

from pagedllm import envs
from pagedllm.engine.cli_fields import add_dataclass_args, arg, positive_int

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20
# Names known here without importing the parsers (the CLI builds every parser at start).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_xml")
REASONING_PARSERS = ("deepseek_r1", "qwen3")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _metrics_prefix(value: str) -> str:
    if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", value):
        raise argparse.ArgumentTypeError(f"must be a Prometheus name ([a-zA-Z_][a-zA-Z0-9_]*), got {value!r}")
    return value


@dataclass
class FrontendArgs:
    """The HTTP server's knobs (the engine's are EngineArgs')."""

    model_tag: Optional[str] = arg(
        None, "model directory (same as --model); default: SmolLM2-135M-Instruct", flag="model_tag", nargs="?"
    )
    host: str = arg("127.0.0.1", "address to listen on")
    port: int = arg(8000, "port to listen on")
    served_model_name: Optional[list] = arg(
        None, "the name(s) clients give as `model` (default: the model as given)", nargs="+"
    )
    api_key: Optional[str] = arg(
        None,
        "require 'Authorization: Bearer KEY' on /v1, /tokenize, /detokenize (default: $PAGEDLLM_API_KEY, else none)",
        cli_default=lambda: envs.PAGEDLLM_API_KEY,
    )
    max_waiting_requests: int = arg(1024, "refuse with 503 a request that would make more than this many wait")
    max_request_body_bytes: int = arg(
        DEFAULT_MAX_REQUEST_BODY_BYTES,
        "refuse with 413 a request body larger than this, before reading it whole (default 8388608 = 8 MiB)",
        type=positive_int,
    )
    restart_engine_on_failure: bool = arg(
        False,
        "when the engine core process dies, start a new one (the requests in flight get 503) instead "
        "of exiting 1 for a supervisor to restart the server",
    )
    chat_template: Optional[str] = arg(None, "a Jinja chat template, or a file holding one")
    enable_auto_tool_choice: bool = arg(
        False, 'let the model decide to call tools (tool_choice "auto"); needs --tool-call-parser'
    )
    tool_call_parser: Optional[str] = arg(
        None,
        "how the model writes tool calls: hermes (<tool_call>{json}</tool_call>), llama3_json "
        '({"name", "parameters"}), mistral ([TOOL_CALLS]...), pythonic ([f(a=1)]) or qwen3_xml '
        "(Qwen3-Coder's <function=f><parameter=a>)",
        choices=TOOL_CALL_PARSERS,
    )
    reasoning_parser: Optional[str] = arg(
        None, "split <think>...</think> off the answer into reasoning_content", choices=REASONING_PARSERS
    )
    # Not log_level: the `pagedllm` command's own --log-level keeps that name.
    serve_log_level: str = arg("info", "the server's log level", flag="--log-level", choices=LOG_LEVELS)
    metrics_prefix: str = arg(
        "pagedllm",
        "the namespace of the /metrics series; 'vllm' gives the names vLLM's Grafana "
        "dashboards query (vllm:num_requests_running, ...)",
        type=_metrics_prefix,
    )
    lora_modules: Optional[list] = arg(
        None,
        "LoRA adapters (PEFT directories) served under NAME, the request's `model` (needs --enable-lora)",
        nargs="+",
        metavar="NAME=PATH",
    )
    allow_runtime_lora_updating: bool = arg(
        False,
        "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
        "(default: $PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING, else off)",
        cli_default=lambda: envs.PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING,
    )
    log_stats_interval: float = arg(5.0, "seconds between stats lines while busy")

    def __post_init__(self) -> None:
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"--max-waiting-requests must be >= 0, got {self.max_waiting_requests}")


# What `run-batch` shares with the server: the names, the chat template and the parsers.
RUN_BATCH_FIELDS = (
    "served_model_name",
    "chat_template",
    "enable_auto_tool_choice",
    "tool_call_parser",
    "reasoning_parser",
)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_dataclass_args(p, FrontendArgs)
