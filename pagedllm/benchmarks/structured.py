"""`pagedllm bench structured`: the same chat requests with a JSON schema (structured output) and
unconstrained, in one run: output tokens per second of each (the goal: at most 10 % slower)."""

from __future__ import annotations

import argparse
import gc
import json
import time

from pagedllm.benchmarks.common import command_line, machine_info, print_table, write_json

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
            "required": ["city", "country"],
        },
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "skills", "address", "employed"],
}
PEOPLE = [
    "a chef from Lyon",
    "a pilot from Oslo",
    "a teacher from Lima",
    "a nurse from Pune",
    "a poet from Cork",
    "a miner from Perth",
    "a judge from Accra",
    "a baker from Riga",
]


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128, help="max_tokens of each request")
    p.add_argument("--output-json", default=None, metavar="PATH")


def _run(llm, prompts, output_len: int, constrained: bool) -> dict:
    from pagedllm import SamplingParams
    from pagedllm.sampling_params import StructuredOutputsParams

    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = SamplingParams(temperature=0, max_tokens=output_len, structured_outputs=so)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up (and the grammar compiled once)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    valid = 0
    for o in outs:
        try:
            valid += isinstance(json.loads(o.outputs[0].text), dict)
        except ValueError:
            pass
    return {
        "system": "JSON schema" if constrained else "unconstrained",
        "requests": len(prompts),
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "output_tok_s": tokens / elapsed,
        "valid_json": valid,
    }


def main(ns) -> int:
    from pagedllm import LLM
    from pagedllm.entrypoints.cli import engine_args_from

    llm = LLM(**vars(engine_args_from(ns)))
    prompts = [
        {
            "prompt_token_ids": llm.apply_chat_template(
                [
                    {
                        "role": "user",
                        "content": f"Describe {PEOPLE[i % len(PEOPLE)]} (person {i}) as a JSON object with "
                        "name, age, email, skills, address (city, country) and employed.",
                    }
                ]
            )
        }
        for i in range(ns.num_prompts)
    ]
    free = _run(llm, prompts, ns.output_len, constrained=False)
    json_row = _run(llm, prompts, ns.output_len, constrained=True)
    llm.shutdown()
    gc.collect()
    m = machine_info()
    print(f"command: {command_line()}")
    print(f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} with {m['torch_threads']} threads")
    print(f"workload: {ns.num_prompts} chat requests, greedy, max_tokens {ns.output_len}\n")
    print_table(
        [free, json_row],
        [
            ("system", "system", ""),
            ("requests", "requests", "d"),
            ("elapsed_s", "elapsed s", ".2f"),
            ("output_tokens", "output tokens", "d"),
            ("output_tok_s", "output tok/s", ".1f"),
            ("valid_json", "valid JSON", "d"),
        ],
    )
    slower = 1 - json_row["output_tok_s"] / free["output_tok_s"]
    print(f"\nJSON schema vs unconstrained: {100 * slower:+.1f} % slower (goal <= 10 %)")
    if ns.output_json:
        write_json(ns.output_json, {"command": command_line(), "machine": m, "rows": [free, json_row]})
    return 0
