"""Every environment variable pagedllm reads, declared once: its name, default and meaning.

Read them as attributes of this module (`envs.PAGEDLLM_HOME`): each read looks at the
environment at that moment, so a variable set after import (a test, a notebook, a spawned
worker) is seen. A value that does not parse is a ValueError naming the variable.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional


class EnvVar(NamedTuple):
    parse: Callable[[Optional[str]], Any]  # the raw value (None when unset) -> the value
    doc: str


def _text(default: Optional[str]) -> Callable[[Optional[str]], Optional[str]]:
    return lambda raw: raw if raw else default


def _switch(default: bool) -> Callable[[Optional[str]], bool]:
    """Unset or empty: the default; "0": off; anything else: on."""
    return lambda raw: default if not raw else raw != "0"


def _one_of(default: str, allowed: tuple) -> Callable[[Optional[str]], str]:
    def parse(raw: Optional[str]) -> str:
        if raw and raw not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}, not {raw!r}")
        return raw or default

    return parse


def _number(kind: type, default):
    def parse(raw: Optional[str]):
        return default if not raw else kind(raw)

    return parse


VARIABLES: dict[str, EnvVar] = {
    "PAGEDLLM_HOME": EnvVar(
        _text("~/.cache/pagedllm"), "pagedllm's cache: the default model and random:<shape> models"
    ),
    "PAGEDLLM_ENABLE_RESPONSES_API_STORE": EnvVar(
        _switch(False),
        "1: keep /v1/responses made with store (OpenAI's default) for GET and "
        "previous_response_id; unset: store is ignored (vLLM's "
        "VLLM_ENABLE_RESPONSES_API_STORE)",
    ),
    "PAGEDLLM_RESPONSES_STORE_SIZE": EnvVar(
        _number(int, 1024), "responses kept for previous_response_id (store: true); the oldest go first"
    ),
    "PAGEDLLM_RESPONSES_STORE_TTL_S": EnvVar(_number(float, 3600.0), "seconds a stored response is kept"),
    "PAGEDLLM_API_KEY": EnvVar(_text(None), "the server's API key when --api-key is not given"),
    "PAGEDLLM_SERVER_DEV_MODE": EnvVar(
        _switch(False), "1: the server's development routes too (POST /reset_prefix_cache; vLLM's VLLM_SERVER_DEV_MODE)"
    ),
    "PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING": EnvVar(
        _switch(False), "1: as --allow-runtime-lora-updating (POST /v1/load_lora_adapter, /v1/unload_lora_adapter)"
    ),
    "PAGEDLLM_IMAGE_FETCH_TIMEOUT": EnvVar(
        _number(float, 5.0), "seconds an http(s) image_url may take to answer (vLLM's VLLM_IMAGE_FETCH_TIMEOUT)"
    ),
    "PAGEDLLM_MAX_IMAGE_BYTES": EnvVar(
        _number(int, 20 << 20), "largest encoded image an image_url may bring (data, file or http)"
    ),
    "PAGEDLLM_NO_CPU_KERNELS": EnvVar(
        _switch(False), "1: never build or use the C++ CPU kernels (the torch code instead)"
    ),
    "PAGEDLLM_CPU_ISA": EnvVar(
        _text(None),
        "avx2: use the C++ kernels' AVX2 build on an AVX-512 machine "
        "(unset: the best build the CPU runs; csrc/build.py VARIANTS)",
    ),
    "PAGEDLLM_GGUF_ACTIVATIONS": EnvVar(
        _one_of("int8", ("int8", "int16")),
        "GGUF linears quantize their activations per block of 32 to int8 "
        "(llama.cpp's scheme, the faster kernels; per 256 for K-quant weights) or int16 (closer to float); "
        "read when a model loads (docs/quantization.md)",
    ),
    "PAGEDLLM_CPU_PACKED_LINEAR": EnvVar(
        _switch(True), "0: plain F.linear instead of oneDNN-packed and pair-packed bfloat16 linears"
    ),
    "PAGEDLLM_CPU_WEIGHT_COPIES": EnvVar(
        _one_of("auto", ("auto", "1", "2")),
        "CPU float linears: 2 keeps a few-row copy of each weight beside oneDNN's packed one, 1 holds "
        "one copy, auto keeps the second where it fits in memory (models/layers/weight_copies.py)",
    ),
    "PAGEDLLM_CPU_DECODE_LOOP": EnvVar(_switch(True), "0: no C++ loop over the layers of all-decode steps"),
    "PAGEDLLM_CPU_MALLOC_KEEP": EnvVar(
        _switch(True),
        "0: leave glibc's malloc thresholds (a CPU engine keeps freed activations mapped: worker/cpu_malloc.py)",
    ),
    "PAGEDLLM_PP_BATCH_QUEUE": EnvVar(_switch(True), "0: one pipeline-parallel step in flight, not several"),
    "PAGEDLLM_WORKER_START_TIMEOUT_S": EnvVar(
        _number(float, 600.0), "seconds for tp/pp workers to start and load the model"
    ),
    "PAGEDLLM_WORKER_CALL_TIMEOUT_S": EnvVar(_number(float, 300.0), "seconds for a worker to answer a call"),
    "PAGEDLLM_WORKER_THREADS": EnvVar(_number(int, 0), "torch threads per worker (0: the cores split evenly)"),
    "PAGEDLLM_RAY_PLACEMENT_TIMEOUT_S": EnvVar(_number(float, 120.0), "seconds to wait for Ray to place the workers"),
    "PAGEDLLM_DIST_TIMEOUT_S": EnvVar(_number(float, 300.0), "seconds before a torch.distributed collective fails"),
    "PAGEDLLM_FAULT_INJECTION": EnvVar(
        _text(""), "tests only: ACTION:TOKEN_ID,... faults in the model runner (worker/fault_injection.py)"
    ),
}


def pagedllm_home() -> Path:
    """Root of pagedllm's cache: `$PAGEDLLM_HOME` or `~/.cache/pagedllm`."""
    return Path(__getattr__("PAGEDLLM_HOME")).expanduser()


def __getattr__(name: str) -> Any:
    var = VARIABLES.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    raw = os.environ.get(name)
    try:
        return var.parse(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not valid: {var.doc}") from None


def __dir__() -> list[str]:
    return sorted(VARIABLES)
