"""`pagedllm bench roofline`: how close the offline throughput workload comes to the machine's
matrix-multiply rate.

The rate is measured (a large float32 `torch.mm` on all of torch's threads, best of a few);
the work is counted from the model's config: the linear layers for every token that goes
through the model, attention over each token's context (QK^T and PV), and the LM head for each
sampled token. Achieved rate = the workload's FLOPs / its wall time = output tokens/s x FLOPs
per output token.
"""

from __future__ import annotations

import argparse
import time

from pagedllm.benchmarks.common import (
    add_workload_args,
    command_line,
    machine_info,
    print_table,
    workload_requests,
    write_json,
)
from pagedllm.models.hf_config import head_dim_of


def add_cli_args(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    p.add_argument("--mm-size", type=int, default=4096, help="n of the n x n x n torch.mm (default 4096)")
    p.add_argument("--output-json", default=None, metavar="PATH", help="also save the results as JSON")


def measure_mm_rate(n: int, dtype=None, repeats: int = 5) -> float:
    """Best FLOP/s of an n x n by n x n matrix product (2 n^3 FLOPs)."""
    import torch

    dtype = dtype or torch.float32
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.mm(a, b, out=out)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def model_flops(hf: dict) -> dict:
    """FLOPs (multiply-add = 2) of the Llama family, from its config: `linear` per token through
    all layers, `attention_per_ctx` per token per key it attends to, `lm_head` per sampled token."""
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads", heads)
    d = head_dim_of(hf)
    inter, layers = hf["intermediate_size"], hf["num_hidden_layers"]
    q, kv = heads * d, kv_heads * d
    per_layer = h * (q + 2 * kv) + q * h + h * 2 * inter + inter * h  # qkv, o, gate/up, down
    return {
        "linear": 2 * per_layer * layers,
        "attention_per_ctx": 2 * 2 * heads * d * layers,
        "lm_head": 2 * h * hf["vocab_size"],
    }


def workload_flops(f: dict, requests) -> float:
    """A request of P prompt and O output tokens sends P + O - 1 tokens through the model (the
    last output is never fed back); the token at position i attends to i + 1 keys."""
    total = 0.0
    for r in requests:
        n = len(r.prompt_token_ids) + r.output_len - 1
        total += n * f["linear"] + f["attention_per_ctx"] * n * (n + 1) / 2 + r.output_len * f["lm_head"]
    return total


def main(ns: argparse.Namespace) -> int:
    from pagedllm.benchmarks.throughput import run_pagedllm
    from pagedllm.entrypoints.cli import engine_args_from
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(**vars(engine_args_from(ns)))
    mc = llm.llm_engine.config.model_config
    requests = workload_requests(llm.get_tokenizer(), ns)
    machine = machine_info()
    print(f"command: {command_line()}")
    print(
        f"machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']} "
        f"with {machine['torch_threads']} threads"
    )
    peak = measure_mm_rate(ns.mm_size)
    f = model_flops(mc.hf_config)
    row = run_pagedllm(llm, requests)
    work = workload_flops(f, requests)
    achieved = work / row["elapsed_s"]
    per_out = work / row["output_tokens"]
    peak_after = measure_mm_rate(ns.mm_size)  # again: another process may have taken a core
    print(
        f"model: {mc.model}; FLOPs per token: linear {f['linear'] / 1e6:.1f} M, LM head "
        f"{f['lm_head'] / 1e6:.1f} M per sampled token, attention {f['attention_per_ctx'] / 1e3:.1f} K per key"
    )
    print()
    print_table(
        [
            {
                "what": f"torch.mm {ns.mm_size}^3 float32 (before / after)",
                "rate": f"{peak / 1e9:.1f} / {peak_after / 1e9:.1f} GFLOP/s",
            },
            {"what": "workload FLOPs", "rate": f"{work / 1e12:.3f} TFLOP"},
            {"what": "FLOPs per output token", "rate": f"{per_out / 1e9:.3f} GFLOP"},
            {"what": "pagedllm output tok/s", "rate": f"{row['output_tok_s']:.1f}"},
            {"what": "achieved (out tok/s x FLOPs per out token)", "rate": f"{achieved / 1e9:.1f} GFLOP/s"},
        ],
        [("what", "", ""), ("rate", "", "")],
    )
    frac = achieved / max(peak, peak_after)
    print(f"fraction of the measured matrix-multiply rate: {100 * frac:.1f}%")
    if ns.output_json:
        write_json(
            ns.output_json,
            {
                "command": command_line(),
                "machine": machine,
                "model": mc.model,
                "mm_flops_per_s": [peak, peak_after],
                "model_flops": f,
                "workload_flops": work,
                "flops_per_output_token": per_out,
                "pagedllm": row,
                "achieved_flops_per_s": achieved,
                "fraction": frac,
            },
        )
    return 0
