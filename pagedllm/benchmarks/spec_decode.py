"""`pagedllm bench spec-decode`: batch-1 TPOT with and without speculative decoding in one run,
on a workload whose output repeats its input (copying and editing a given text or code: n-gram drafts) and
on one whose output does not (free stories: the adaptive length policy should cost ~nothing).
Greedy; each request runs alone, each prompt on every system in turn (all systems loaded at once);
TPOT = (last token time - first token time) / (tokens - 1)."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics

from pagedllm.benchmarks.common import command_line, machine_info, print_table, write_json
from pagedllm.profiler import PROFILER

STORY = (
    "The lighthouse keeper woke before dawn, as he had every day for thirty years, and climbed the spiral "
    "stairs with a lantern in one hand and a mug of bitter coffee in the other. Outside, the sea was the "
    "colour of wet slate. Gulls argued on the rocks below."
)
STACK = (
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
    "        self.items.append(x)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "    def __len__(self):\n        return len(self.items)\n"
)
# The repeating workload: copying and editing tasks whose answer repeats the given text with few
# changes (the default model does repeat these; asked to copy a merge function it rewrites it as
# `sorted(a + b)` and explains, which is not this workload: docs/history/benchmarks.md).
EDIT_TASKS = [
    "Copy the following exactly, changing nothing:\n\n" + STORY,
    "Copy the following exactly, changing nothing:\n\n" + STACK,
    "Correct the spelling mistakes in this text and return the corrected text:\n\n"
    + STORY.replace("before", "befor").replace("years", "yeers").replace("bitter", "biter").replace("below", "bellow"),
    "Add type hints to this class. Return the whole class.\n\n" + STACK,
    "Add a method peek to this class that returns the top item. Return the whole class.\n\n```python\n" + STACK + "```",
]
FREE_TOPICS = [
    "a dragon who is afraid of the dark",
    "the first day at a new school on Mars",
    "a detective cat in Venice",
]


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output-len", type=int, default=96, help="max_tokens of each request")
    # 7: a verification of k + 1 = 8 tokens is the most linear_small takes (SMALL_ROWS; 3 for float32 on AVX-512,
    # 16 rows of bf16_pair_linear for bfloat16 on AVX512-BF16): one read of the weights
    p.add_argument("--num-speculative-tokens", type=int, default=7)
    p.add_argument(
        "--draft-model",
        default=None,
        metavar="self:N",
        help="also run the draft-model proposer ('self:N' or an HF directory)",
    )
    p.add_argument("--output-json", default=None, metavar="PATH")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also print the median time of a step by its number of tokens (a plain step: 1; "
        "a verification of k drafts: k + 1), from the engine's step profiler",
    )


def _prompts(llm) -> dict[str, list[dict]]:
    tokenizer = llm.get_tokenizer()
    if getattr(tokenizer, "chat_template", None):

        def ids(text: str) -> list[int]:
            return llm.apply_chat_template([{"role": "user", "content": text}])
    else:  # a base or random model: the instruction as plain text

        def ids(text: str) -> list[int]:
            return tokenizer(text)["input_ids"]

    copy = [ids(t) for t in EDIT_TASKS]
    free = [ids(f"Write a short story about {t}.") for t in FREE_TOPICS]
    return {
        "repeating": [{"prompt_token_ids": p} for p in copy],
        "non-repeating": [{"prompt_token_ids": p} for p in free],
    }


def _run(llm, prompt, params, profile: bool) -> tuple[float | None, list[int], list[dict]]:
    """One batch-1 request -> (TPOT in s or None for a 1-token output, its tokens, profiled steps)."""
    if profile:
        PROFILER.start()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    steps = PROFILER.stop() if profile else []
    n, m = len(out.outputs[0].token_ids), out.metrics
    tpot = (m["last_token_time"] - m["first_token_time"]) / (n - 1) if n > 1 else None
    return tpot, list(out.outputs[0].token_ids), steps


def _step_rows(name: str, workload: str, steps: list[dict]) -> list[dict]:
    """Median wall time of the profiled steps by their number of tokens (all phases)."""
    by_tokens: dict[int, list[float]] = {}
    for st in steps:
        by_tokens.setdefault(int(st["num_tokens"]), []).append(
            sum(v for k, v in st.items() if k not in ("num_tokens", "num_reqs"))
        )
    return [
        {"system": name, "workload": workload, "tokens": n, "steps": len(ts), "median_ms": 1000 * statistics.median(ts)}
        for n, ts in sorted(by_tokens.items())
        if n <= 17
    ]


def _spec_counts(llm) -> tuple[int, int]:
    stats = llm.llm_engine.core.scheduler.spec_decoding_stats
    return stats.num_draft_tokens, stats.num_accepted_tokens


def main(ns) -> int:
    from pagedllm import LLM
    from pagedllm.entrypoints.cli import engine_args_from

    base_args = engine_args_from(ns)
    k = ns.num_speculative_tokens
    systems = [
        ("no speculation", None),
        (f"ngram k={k} fixed", {"method": "ngram", "num_speculative_tokens": k}),
        (f"ngram k<={k} adaptive", {"method": "ngram", "num_speculative_tokens": k, "length_policy": "adaptive"}),
    ]
    if ns.draft_model:
        systems.append(
            (
                f"draft {ns.draft_model} k={k}",
                {"method": "draft_model", "model": ns.draft_model, "num_speculative_tokens": k},
            )
        )
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=ns.output_len)
    # All systems live at once and take each prompt in turn, so that a drift in the machine's
    # speed during the run (shared CPUs) falls on every system alike.
    llms = [LLM(**vars(dataclasses.replace(base_args, speculative_config=spec))) for _, spec in systems]
    rows, step_rows = [], []
    for workload, prompts in _prompts(llms[0]).items():
        tpots = [[] for _ in systems]
        tokens = [[] for _ in systems]
        steps = [[] for _ in systems]
        before = [_spec_counts(llm) for llm in llms]
        for llm in llms:  # warm-up
            llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        for p in prompts:
            for i, llm in enumerate(llms):
                tpot, toks, st = _run(llm, p, params, ns.profile)
                if tpot is not None:
                    tpots[i].append(tpot)
                tokens[i].append(toks)
                steps[i] += st
        base_tpot = statistics.mean(tpots[0])
        for i, (name, _) in enumerate(systems):
            drafted, accepted = (x - y for x, y in zip(_spec_counts(llms[i]), before[i]))
            tpot = statistics.mean(tpots[i])
            rows.append(
                {
                    "system": name,
                    "workload": workload,
                    "tpot_ms": 1000 * tpot,
                    "speedup": base_tpot / tpot,
                    "drafted": drafted,
                    "acceptance": accepted / drafted if drafted else 0.0,
                    "same_tokens": tokens[i] == tokens[0],
                }
            )
            if ns.profile:
                step_rows += _step_rows(name, workload, steps[i])
    for llm in llms:
        llm.shutdown()
    del llms
    gc.collect()
    m = machine_info()
    print(f"command: {command_line()}")
    print(f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} with {m['torch_threads']} threads")
    print(
        f"workload: batch 1, greedy, max_tokens {ns.output_len}; {len(EDIT_TASKS)} copy / edit prompts, "
        f"{len(FREE_TOPICS)} story prompts\n"
    )
    print_table(
        rows,
        [
            ("system", "system", ""),
            ("workload", "workload", ""),
            ("tpot_ms", "TPOT ms", ".1f"),
            ("speedup", "speedup", ".2f"),
            ("drafted", "drafted", "d"),
            ("acceptance", "acceptance", ".2f"),
            ("same_tokens", "same tokens", ""),
        ],
    )
    if step_rows:
        print("\nstep time by tokens in the step (batch 1: 1 = a plain step, k + 1 = a verification):")
        print_table(
            step_rows,
            [
                ("system", "system", ""),
                ("workload", "workload", ""),
                ("tokens", "tokens", "d"),
                ("steps", "steps", "d"),
                ("median_ms", "median ms", ".1f"),
            ],
        )
    if ns.output_json:
        write_json(ns.output_json, {"command": command_line(), "machine": m, "rows": rows, "steps": step_rows})
    return 0
