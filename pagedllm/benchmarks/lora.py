"""`pagedllm bench lora`: the same requests spread over N LoRA adapters (rank r on every
projection) and on the base model, in one engine run each (goal: >= 0.75x the base model's
output tok/s on the CPU). The adapters are written by the bench in PEFT's format with random
weights (the speed does not depend on the values)."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from pagedllm.benchmarks.common import command_line, machine_info, print_table, random_requests, write_json


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--input-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"))
    p.add_argument("--output-json", default=None, metavar="PATH")


def write_random_adapter(hf: dict, out: str, rank: int, seed: int) -> str:
    """A PEFT adapter directory on every q/k/v/o/gate/up/down projection, A and B ~ N(0, 0.02^2)."""
    import torch
    from safetensors.torch import save_file

    from pagedllm.lora.peft_helper import TARGETS, projection_shapes

    g = torch.Generator().manual_seed(seed)
    shapes, tensors = projection_shapes(hf), {}
    for layer in range(hf["num_hidden_layers"]):
        for proj, (module, _) in TARGETS.items():
            prefix = f"base_model.model.model.layers.{layer}.{module.split('.')[0]}.{proj}"
            n_out, n_in = shapes[proj]
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.02
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none"}, f
        )
    return out


def _run(llm, reqs, loras, label: str) -> dict:
    from pagedllm import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False, lora_request=loras[:2])  # warm-up (adapters read)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "system": label,
        "requests": len(reqs),
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "output_tok_s": tokens / elapsed,
    }


def main(ns) -> int:
    from pagedllm import LLM
    from pagedllm.entrypoints.cli import engine_args_from
    from pagedllm.lora import LoRARequest

    args = engine_args_from(ns)
    args.enable_lora, args.max_loras, args.max_lora_rank = True, ns.num_adapters, ns.rank
    llm = LLM(**vars(args))
    hf = llm.llm_engine.config.model_config.hf_config
    reqs = random_requests(llm.get_tokenizer(), ns.num_prompts, tuple(ns.input_len), tuple(ns.output_len), seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [
            LoRARequest(f"bench-{i}", i + 1, write_random_adapter(hf, f"{tmp}/a{i}", ns.rank, i))
            for i in range(ns.num_adapters)
        ]
        # The base rows run through the same engine: with no adapter in a step the wrapped
        # layers compute exactly the base method (and the C++ decode loop applies).
        base = _run(llm, reqs, [None] * len(reqs), "base model")
        lora = _run(
            llm,
            reqs,
            [adapters[i % len(adapters)] for i in range(len(reqs))],
            f"{ns.num_adapters} adapters, rank {ns.rank}",
        )
    llm.shutdown()
    m = machine_info()
    print(f"command: {command_line()}")
    print(f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} with {m['torch_threads']} threads")
    print(
        f"workload: {ns.num_prompts} requests, input {ns.input_len[0]}-{ns.input_len[1]}, output "
        f"{ns.output_len[0]}-{ns.output_len[1]} tokens (ignore_eos), adapters round robin, all projections\n"
    )
    print_table(
        [base, lora],
        [
            ("system", "system", ""),
            ("requests", "requests", "d"),
            ("elapsed_s", "elapsed s", ".2f"),
            ("output_tokens", "output tokens", "d"),
            ("output_tok_s", "output tok/s", ".1f"),
        ],
    )
    ratio = lora["output_tok_s"] / base["output_tok_s"]
    print(f"\nLoRA vs base: {ratio:.2f}x the base model's output tok/s (goal >= 0.75x)")
    if ns.output_json:
        write_json(ns.output_json, {"command": command_line(), "machine": m, "rows": [base, lora], "ratio": ratio})
    return 0
