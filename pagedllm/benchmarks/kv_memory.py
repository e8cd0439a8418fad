"""`pagedllm bench kv-memory`: the KV cache one long request holds, step by step, with KV cache
groups (core/kv_cache_utils.py: a sliding group frees the blocks behind its window) against the
layout without them (one block table for every layer, so no block is ever freed: Gemma 3
before groups). One greedy request of --input-len random tokens generating --output-len.

"With freeing" is read from the KV cache manager each step (blocks held in every group x the
bytes of a block: one layer of each group); "without" is the same request's token count in
blocks of every layer's page (what the single-table layout holds: it frees nothing).

--per-request: a hybrid's bytes per request against an all-attention model's
(kv_memory_per_request.py).
"""

from __future__ import annotations

import argparse

from pagedllm.benchmarks import kv_memory_per_request
from pagedllm.benchmarks.common import command_line, machine_info, print_table, random_requests, write_json


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=2048)
    p.add_argument("--dataset-seed", type=int, default=0)
    p.add_argument("--output-json", default=None, metavar="PATH", help="also save the results as JSON")
    kv_memory_per_request.add_cli_args(p)


def main(args: argparse.Namespace) -> int:
    if args.per_request:
        return kv_memory_per_request.main(args)
    from pagedllm.entrypoints.cli import engine_args_from
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    machine = machine_info()
    print(f"command: {command_line()}")
    print(f"machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}")
    llm = LLM(**vars(engine_args_from(args)))
    engine = llm.llm_engine
    kv = engine.core.scheduler.kv_cache_manager
    cfg = kv.kv_cache_config
    block_bytes = engine.core.model_executor.kv_bytes_per_block()
    # Without groups a block holds every layer's page; with them, one layer's of each group.
    all_layers_block_bytes = block_bytes * len(cfg.tensor_of_layer) // cfg.num_tensors
    bs = kv.block_size
    prompt = random_requests(llm.get_tokenizer(), 1, (args.input_len,) * 2, (1, 1), args.dataset_seed)[
        0
    ].prompt_token_ids
    engine.add_request(
        "kv", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    )
    rows, peak = [], (0, 0)
    marks = {args.input_len + n for n in range(0, args.output_len, 128)} | {args.input_len + args.output_len - 1}
    while engine.has_unfinished_requests():
        engine.step()
        request = engine.core.scheduler.get_request("kv")
        if request is None:
            break
        held = kv.get_num_blocks_by_group("kv")
        with_groups = sum(held) * block_bytes
        without = -(request.num_computed_tokens // -bs) * all_layers_block_bytes
        peak = max(peak, (with_groups, without))
        if request.num_computed_tokens in marks:
            rows.append(
                {
                    "tokens": request.num_computed_tokens,
                    "blocks": " ".join(map(str, held)),
                    "groups_mib": with_groups / 2**20,
                    "one_table_mib": without / 2**20,
                    "saving": without / with_groups,
                }
            )
            print(f"{request.num_computed_tokens} tokens: blocks per group {held}", flush=True)
    print(
        f"{len(cfg.kv_cache_groups)} KV cache groups (windows "
        f"{[g.sliding_window for g in cfg.kv_cache_groups]}), {cfg.num_tensors} shared tensors, "
        f"block {bs} tokens = {block_bytes} bytes (every layer's: {all_layers_block_bytes})"
    )
    print_table(
        rows,
        [
            ("tokens", "tokens", "d"),
            ("blocks", "blocks per group", "s"),
            ("groups_mib", "KV MiB, groups (freeing)", ".2f"),
            ("one_table_mib", "KV MiB, one table (no freeing)", ".2f"),
            ("saving", "saving", ".2f"),
        ],
    )
    print(f"peak: {peak[0] / 2**20:.2f} MiB with groups, {peak[1] / 2**20:.2f} MiB without")
    if args.output_json:
        write_json(args.output_json, {"rows": rows, "peak_bytes_groups": peak[0], "peak_bytes_one_table": peak[1]})
    return 0
