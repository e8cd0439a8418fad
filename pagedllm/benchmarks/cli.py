"""Wires the benchmark subcommands into `pagedllm bench`."""
from __future__ import annotations


def add_bench_parser(sub, add_engine_args) -> None:
    bench = sub.add_parser("bench", help="benchmarks (each prints a baseline beside pagedllm)")
    bsub = bench.add_subparsers(dest="bench_cmd", required=True)
    from pagedllm.benchmarks import throughput
    p = bsub.add_parser("throughput", help="offline throughput vs transformers generate")
    add_engine_args(p)
    throughput.add_cli_args(p)
    p.set_defaults(func=throughput.main)
    from pagedllm.benchmarks import prefix_caching
    p = bsub.add_parser("prefix-caching", help="shared-prefix workload, prefix caching on vs off")
    add_engine_args(p)
    prefix_caching.add_cli_args(p)
    p.set_defaults(func=prefix_caching.main)
    from pagedllm.benchmarks import roofline
    p = bsub.add_parser("roofline", help="the throughput workload's FLOP/s vs the measured torch.mm rate")
    add_engine_args(p)
    roofline.add_cli_args(p)
    p.set_defaults(func=roofline.main)
    from pagedllm.benchmarks import latency
    p = bsub.add_parser("latency", help="batch-1 / batch-N step latency, per-phase profile, llama.cpp baseline")
    add_engine_args(p)
    latency.add_cli_args(p)
    p.set_defaults(func=latency.main)
    from pagedllm.benchmarks import serve
    p = bsub.add_parser("serve", help="load a running server: throughput, TTFT / TPOT / ITL / E2E percentiles")
    serve.add_cli_args(p)
    p.set_defaults(func=serve.main)
