"""`pagedllm bench priority`: time to first token of urgent requests against the others under a
full queue, first come first served vs --scheduling-policy priority.

--num-prompts random requests are all queued at once (many more than --max-num-seqs run at a
time), the urgent ones (every --urgent-every-th) queued last, the worst place under FCFS. Under
the priority policy they carry priority -1 (the others 0) and start first, preempting running
requests when they need the room. The same requests on two engines, the policies in turn
(--repeat rounds, interleaved); medians of each class's TTFT, and the ratio others / urgent.
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagedllm.benchmarks.common import command_line, machine_info, print_table, random_requests, write_json


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--urgent-every", type=int, default=6, help="every N-th request is urgent (default 6)")
    p.add_argument("--repeat", type=int, default=2, help="rounds, the two policies in turn (default 2)")
    p.add_argument("--dataset-seed", type=int, default=0)
    p.add_argument("--output-json", default=None, metavar="PATH", help="also save the results as JSON")


def ttfts(engine, prompts: list[list[int]], urgent: set[int], priority: bool, params) -> dict[str, list[float]]:
    """Queue every request at once (the urgent ones last) and step until all end -> TTFT by class."""
    order = [i for i in range(len(prompts)) if i not in urgent] + sorted(urgent)
    start = time.perf_counter()
    for i in order:
        engine.add_request(
            f"r{i}", {"prompt_token_ids": prompts[i]}, params, priority=-1 if priority and i in urgent else 0
        )
    first: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id not in first and out.outputs[0].token_ids:
                first[out.request_id] = time.perf_counter() - start
    by_class: dict[str, list[float]] = {"urgent": [], "others": []}
    for i in range(len(prompts)):
        by_class["urgent" if i in urgent else "others"].append(first[f"r{i}"])
    return by_class


def main(args: argparse.Namespace) -> int:
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.cli import engine_args_from
    from pagedllm.sampling_params import SamplingParams

    machine = machine_info()
    print(f"command: {command_line()}")
    print(f"machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}")
    engines = {}
    for policy in ("fcfs", "priority"):
        args.scheduling_policy = policy
        engines[policy] = LLMEngine.from_engine_args(engine_args_from(args))
    tokenizer = engines["fcfs"].tokenizer
    reqs = random_requests(
        tokenizer, args.num_prompts, (args.input_len,) * 2, (args.output_len,) * 2, args.dataset_seed
    )
    prompts = [r.prompt_token_ids for r in reqs]
    urgent = set(range(args.urgent_every - 1, args.num_prompts, args.urgent_every))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    ttfts(engines["fcfs"], prompts[:2], set(), False, params)  # warm-up: kernels built, caches touched
    runs: dict[str, dict[str, list[float]]] = {p: {"urgent": [], "others": []} for p in engines}
    for _ in range(args.repeat):
        for policy, engine in engines.items():
            got = ttfts(engine, prompts, urgent, policy == "priority", params)
            for cls, values in got.items():
                runs[policy][cls].append(statistics.median(values))
    rows = []
    for policy in engines:
        u, o = statistics.median(runs[policy]["urgent"]), statistics.median(runs[policy]["others"])
        rows.append({"policy": policy, "urgent": u, "others": o, "ratio": o / u})
    print(
        f"{args.num_prompts} requests ({len(urgent)} urgent, queued last), {args.input_len} + "
        f"{args.output_len} tokens, max_num_seqs {args.max_num_seqs}, {args.repeat} rounds"
    )
    print_table(
        rows,
        [
            ("policy", "policy", "s"),
            ("urgent", "urgent TTFT s (median)", ".3f"),
            ("others", "others TTFT s (median)", ".3f"),
            ("ratio", "others / urgent", ".2f"),
        ],
    )
    if args.output_json:
        write_json(args.output_json, {"rows": rows, "runs": runs})
    return 0
