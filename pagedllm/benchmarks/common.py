"""Shared by the benchmarks: the machine, the command line, random requests, a results table, JSON."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from dataclasses import dataclass

import numpy as np


def machine_info() -> dict:
    """What a reader needs to judge the figures: CPU model, cores usable here, torch threads."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": cpu,
        "cores": cores,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def command_line() -> str:
    """The command as the user typed it (`python -m ...cli` shows as such, not as a file path)."""
    argv0 = sys.argv[0]
    prog = (
        "python -m pagedllm.entrypoints.cli"
        if argv0.endswith(os.path.join("entrypoints", "cli.py"))
        else os.path.basename(argv0)
    )
    return " ".join([prog, shlex.join(sys.argv[1:])]).strip()


@dataclass
class Req:
    prompt_token_ids: list[int]
    output_len: int


def random_requests(tokenizer, num: int, in_range: tuple[int, int], out_range: tuple[int, int], seed: int) -> list[Req]:
    """A fixed set: ids from the ordinary vocabulary (no special or added tokens, which could
    end or reshape a sequence), lengths uniform in the inclusive ranges."""
    for name, (lo, hi) in (("input", in_range), ("output", out_range)):
        if not (1 <= lo <= hi):
            raise ValueError(f"{name} lengths must satisfy 1 <= min <= max, got {lo}..{hi}")
    rng = np.random.default_rng(seed)
    excluded = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    vocab = np.setdiff1d(np.arange(tokenizer.vocab_size), np.fromiter(excluded, dtype=np.int64))
    in_lens = rng.integers(in_range[0], in_range[1] + 1, size=num)
    out_lens = rng.integers(out_range[0], out_range[1] + 1, size=num)
    return [Req(rng.choice(vocab, size=int(n)).tolist(), int(m)) for n, m in zip(in_lens, out_lens)]


def add_workload_args(p) -> None:
    """The offline throughput workload of BENCHMARKS.md (shared by throughput / roofline)."""
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--min-input-len", type=int, default=16)
    p.add_argument("--max-input-len", type=int, default=512)
    p.add_argument("--min-output-len", type=int, default=16)
    p.add_argument("--max-output-len", type=int, default=256)
    p.add_argument("--dataset-seed", type=int, default=0, help="seed of the random requests")


def workload_requests(tokenizer, ns) -> list[Req]:
    if ns.num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {ns.num_prompts}")
    return random_requests(
        tokenizer,
        ns.num_prompts,
        (ns.min_input_len, ns.max_input_len),
        (ns.min_output_len, ns.max_output_len),
        ns.dataset_seed,
    )


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format spec); right-aligned except the first; a key a row lacks
    leaves its cell blank."""
    cells = [[h for _, h, _ in columns]] + [[format(r[k], f) if k in r else "" for k, _, f in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    for j, row in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def print_profile(name: str, prof: dict) -> None:
    """A per-phase step profile (profiler.summarize's) as a table."""
    if not prof.get("steps"):
        return
    print(
        f"\n{name}: {prof['steps']} steps, {prof['mean_tokens']:.0f} tokens / {prof['mean_reqs']:.0f} "
        f"requests a step, {prof['step_ms']:.2f} ms a step"
    )
    print_table(
        [{"phase": p, "ms": v["ms"], "pct": v["pct"]} for p, v in prof["phases"].items()],
        [("phase", "phase", ""), ("ms", "ms / step", ".3f"), ("pct", "% of step", ".1f")],
    )
    print(f"engine overhead (all but forward): {prof['overhead_pct']:.1f}% of the step")
