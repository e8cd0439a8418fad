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
