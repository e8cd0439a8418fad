"""`pagedllm bench prefix-caching`: a shared-prefix workload (one long system prompt, many short
questions) with automatic prefix caching on and off, in one run: throughput, mean TTFT, hit rate."""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import numpy as np

from pagedllm.benchmarks.common import command_line, machine_info, print_table, write_json


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--system-len", type=int, default=1000, help="tokens of the shared system prompt")
    p.add_argument("--question-len", type=int, default=24, help="tokens of each question")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--dataset-seed", type=int, default=0)
    p.add_argument("--output-json", default=None, metavar="PATH")


def _run(engine_args, prompts, output_len: int, caching: bool) -> dict:
    from pagedllm import LLM, SamplingParams

    args = dict(vars(engine_args))
    args["enable_prefix_caching"] = caching
    llm = LLM(**args)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [7] * 8}], params, use_tqdm=False)  # warm-up, shares nothing
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs]
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(p) for p in prompts)
    stats = llm.llm_engine.core.scheduler.kv_cache_manager.stats
    row = {
        "system": f"prefix caching {'on' if caching else 'off'}",
        "requests": len(prompts),
        "elapsed_s": elapsed,
        "output_tok_s": out_tokens / elapsed,
        "total_tok_s": (in_tokens + out_tokens) / elapsed,
        "mean_ttft_s": statistics.mean(ttft),
        "hit_rate": stats.hit_rate if caching else 0.0,
        "cached_tokens": sum(o.num_cached_tokens for o in outs),
    }
    del llm
    gc.collect()
    return row, [o.outputs[0].token_ids for o in outs]


def _vocab_size(engine_args) -> int:
    import json

    from pagedllm.models.download import resolve_model

    path = resolve_model(engine_args.model, getattr(engine_args, "quantization", None))
    return json.loads((path / "config.json").read_text())["vocab_size"]


def main(ns) -> int:
    from pagedllm.entrypoints.cli import engine_args_from

    engine_args = engine_args_from(ns)
    hi = min(40000, _vocab_size(engine_args))  # ids the model has (a small test model too)
    rng = np.random.default_rng(ns.dataset_seed)
    system = rng.integers(100, hi, ns.system_len).tolist()
    prompts = [system + rng.integers(100, hi, ns.question_len).tolist() for _ in range(ns.num_prompts)]
    if engine_args.max_model_len is None:
        engine_args.max_model_len = ns.system_len + ns.question_len + ns.output_len + 16
    off, ref = _run(engine_args, prompts, ns.output_len, caching=False)
    on, got = _run(engine_args, prompts, ns.output_len, caching=True)
    m = machine_info()
    print(f"command: {command_line()}")
    print(f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} with {m['torch_threads']} threads")
    print(
        f"workload: {ns.num_prompts} requests = one {ns.system_len}-token system prompt + "
        f"{ns.question_len}-token question each, {ns.output_len} output tokens, greedy\n"
    )
    print_table(
        [off, on],
        [
            ("system", "system", ""),
            ("requests", "requests", "d"),
            ("elapsed_s", "elapsed s", ".2f"),
            ("output_tok_s", "output tok/s", ".1f"),
            ("total_tok_s", "total tok/s", ".1f"),
            ("mean_ttft_s", "mean TTFT s", ".3f"),
            ("hit_rate", "hit rate", ".3f"),
            ("cached_tokens", "cached tokens", "d"),
        ],
    )
    print(
        f"\nthroughput ratio (on / off): {on['output_tok_s'] / off['output_tok_s']:.2f}x; "
        f"mean TTFT ratio (off / on): {off['mean_ttft_s'] / on['mean_ttft_s']:.2f}x; "
        f"outputs identical: {got == ref}"
    )
    if ns.output_json:
        write_json(
            ns.output_json,
            {"command": command_line(), "machine": m, "rows": [off, on], "outputs_identical": got == ref},
        )
    return 0
