"""`pagedllm bench latency --against vllm`: time per output token of B requests (B = 1: a single
stream) through pagedllm and through vLLM's CPU build, interleaved, medians side by side.

Each engine runs in a process of its own on the same job (job.py, offline.py's runners): the same
prompt token ids, greedy, ignore_eos, prefix caching off. Both are timed the same way from
outside, over whole generate calls: the B prompts with output_len tokens each, then the same
prompts with one token each; TPOT = (full - first token) / (output_len - 1), every decode step
of the batch, scheduling and sampling included, and TTFT the one-token call's time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from pagedllm.benchmarks.against import offline as O
from pagedllm.benchmarks.common import print_table, random_requests, write_json


def check_args(ns: argparse.Namespace) -> None:
    """offline.py's checks, and what a TPOT needs: at least two output tokens."""
    O.check_args(ns)
    if ns.output_len < 2:
        raise ValueError(
            f"output_len must be >= 2 with --against vllm (a TPOT needs a decode step), got {ns.output_len}"
        )
    if ns.profile or ns.llama_cpp or ns.compare_quantization or ns.torch_profile:
        raise ValueError("--against vllm runs alone: not with --profile, --llama-cpp, --compare-* or --torch-profile")


def summarize(runs: list[dict]) -> dict:
    """Median TPOT / TTFT of one system's runs at one batch, with the TPOT's spread."""
    tpots = [r["tpot_ms"] for r in runs]
    med = statistics.median(tpots)
    return {
        "system": runs[0]["system"],
        "version": runs[0]["version"],
        "batch": runs[0]["requests"],
        "runs": len(runs),
        "tpot_ms": med,
        "min_tpot_ms": min(tpots),
        "max_tpot_ms": max(tpots),
        "spread_pct": 100 * (max(tpots) - min(tpots)) / med,
        "ttft_s": statistics.median(r["first_token_s"] for r in runs),
        "decode_tok_s": runs[0]["requests"] * 1e3 / med,
    }


def main(ns: argparse.Namespace) -> int:
    for name, v in (("input_len", ns.input_len), *(("batch_size", b) for b in ns.batch_size)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    check_args(ns)
    s = O.prepare(ns)
    if max(ns.batch_size) > s.eargs.max_num_seqs:
        raise ValueError(f"batch_size {max(ns.batch_size)} exceeds --max-num-seqs {s.eargs.max_num_seqs}")
    print(
        f"batches {ns.batch_size}: input {ns.input_len}, output {ns.output_len} tokens each, seed "
        f"{ns.dataset_seed} + batch (bench latency's prompts); KV cache {s.kv_gib} GiB; "
        f"{ns.repeat} interleaved run(s) each"
    )
    rows, ratios, runs = [], {}, {}
    with tempfile.TemporaryDirectory(prefix="pagedllm-against-") as tmp:
        tmp = Path(tmp)
        for b in ns.batch_size:
            reqs = random_requests(
                s.tokenizer, b, (ns.input_len, ns.input_len), (ns.output_len, ns.output_len), ns.dataset_seed + b
            )
            job = tmp / f"job-{b}.json"
            O.write_job(s, job, reqs, first_token_run=True)
            pairs = [O.run_pair(s, tmp, job, f"batch {b}, {i + 1}/{ns.repeat}") for i in range(ns.repeat)]
            mine, theirs = summarize([p for p, _ in pairs]), summarize([v for _, v in pairs])
            rows += [mine, theirs]
            ratios[b] = [v["tpot_ms"] / p["tpot_ms"] for p, v in pairs]
            for r in (p for pair in pairs for p in pair):
                r.pop("output_token_ids", None)
            runs[b] = pairs
    print()
    print_table(
        rows,
        [
            ("system", "system", ""),
            ("batch", "batch", "d"),
            ("tpot_ms", "median TPOT ms", ".2f"),
            ("min_tpot_ms", "min", ".2f"),
            ("max_tpot_ms", "max", ".2f"),
            ("spread_pct", "spread %", ".1f"),
            ("decode_tok_s", "decode tok/s", ".1f"),
            ("ttft_s", "TTFT s", ".3f"),
        ],
    )
    for b in ns.batch_size:
        mine, theirs = (r for r in rows if r["batch"] == b)
        print(
            f"batch {b}: vLLM TPOT / pagedllm TPOT (medians): {theirs['tpot_ms'] / mine['tpot_ms']:.2f}× "
            "(> 1: pagedllm's steps are shorter; per interleaved pair: "
            + ", ".join(f"{r:.2f}" for r in ratios[b])
            + ")"
        )
    if ns.output_json:
        write_json(
            ns.output_json,
            {
                **O.json_header(s),
                "summary": rows,
                "runs": {str(b): pairs for b, pairs in runs.items()},
                "tpot_ratios_per_pair": {str(b): r for b, r in ratios.items()},
            },
        )
        print(f"saved {ns.output_json}")
    return 0
