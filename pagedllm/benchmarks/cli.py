"""Wires the benchmark subcommands into `pagedllm bench`."""

from __future__ import annotations

import importlib

# (subcommand, module in pagedllm.benchmarks, help, takes the engine flags)
BENCHMARKS = [
    ("throughput", "throughput", "offline throughput vs transformers generate", True),
    ("prefix-caching", "prefix_caching", "shared-prefix workload, prefix caching on vs off", True),
    ("roofline", "roofline", "the throughput workload's FLOP/s vs the measured torch.mm rate", True),
    ("latency", "latency", "batch-1 / batch-N step latency, per-phase profile, llama.cpp baseline", True),
    ("perplexity", "perplexity", "perplexity on a fixed text per dtype (float32 / bfloat16) vs transformers", False),
    (
        "spec-decode",
        "spec_decode",
        "batch-1 TPOT with and without speculative decoding (n-gram, adaptive, draft)",
        True,
    ),
    ("structured", "structured", "requests with a JSON schema vs the same requests unconstrained", True),
    ("lora", "lora", "requests over N LoRA adapters vs the same requests on the base model", True),
    ("serve", "serve", "load a running server: throughput, TTFT / TPOT / ITL / E2E percentiles", False),
    (
        "gguf-kernel",
        "gguf_kernel",
        "a GGUF matrix in its blocks vs the int4/int8 layout and float32, each ISA build",
        False,
    ),
    ("linear", "linear", "a layer's float linears: linear_small vs oneDNN's packed, per row count", False),
    ("attention", "attention", "decode attention kernel bandwidth vs the device's copy rate", False),
    ("prefill-attention", "prefill_attention", "prefill attention over a prompt: the C++ paged kernel vs SDPA", False),
    ("priority", "priority", "urgent requests' TTFT vs the others' under a full queue, fcfs vs priority", True),
    ("encoder", "encoder", "an encoder model's embeddings, batched across requests vs one at a time", False),
    ("vision", "vision", "an image in a chat: encode time, TTFT of turn 1 vs turn 2 reusing the image", False),
    ("kv-memory", "kv_memory", "KV cache held by one long request, sliding groups freeing vs one table", True),
]


def add_bench_parser(sub, add_engine_args) -> None:
    bench = sub.add_parser("bench", help="benchmarks (each prints a baseline beside pagedllm)")
    bsub = bench.add_subparsers(dest="bench_cmd", required=True)
    for name, module, help_text, engine_flags in BENCHMARKS:
        mod = importlib.import_module(f"pagedllm.benchmarks.{module}")
        p = bsub.add_parser(name, help=help_text)
        if engine_flags:
            add_engine_args(p)
        mod.add_cli_args(p)
        p.set_defaults(func=mod.main)
