"""The engine CLI generated from EngineArgs' fields: vLLM's flag names, aliases, --no-X switches
and defaults, and the GiB -> bytes hand-over, against values written out by hand."""

import argparse
from dataclasses import dataclass
from typing import Optional

import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.cli_fields import add_dataclass_args, arg, dataclass_from_args
from pagedllm.entrypoints.cli import add_engine_args, engine_args_from


def _parse(argv):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_args_from(p.parse_args(argv))


def test_no_flags_give_the_fields_defaults():
    assert _parse([]) == EngineArgs()


def test_flags_aliases_and_switches():
    a = _parse(
        [
            "-tp",
            "2",
            "-pp",
            "3",
            "-dp",
            "4",
            "-q",
            "int4",
            "--no-enable-prefix-caching",
            "--no-enable-chunked-prefill",
            "--enforce-eager",
            "--async-scheduling",
            "--cudagraph-mode",
            "full_decode_only",
            "--kv-cache-memory",
            "1.5",
            "--max-cpu-loras",
            "3",
        ]
    )
    assert (a.tensor_parallel_size, a.pipeline_parallel_size, a.data_parallel_size) == (2, 3, 4)
    assert a.quantization == "int4" and a.max_cpu_loras == 3
    assert a.enable_prefix_caching is False and a.enable_chunked_prefill is False
    assert a.enforce_eager is True and a.async_scheduling is True
    assert a.cudagraph_mode == "FULL_DECODE_ONLY"
    assert a.kv_cache_memory == 1610612736  # 1.5 GiB in bytes


def test_runner_and_its_older_name_task():
    assert _parse(["--task", "embed"]).runner == "pooling"
    assert _parse(["--runner", "pooling"]).runner == "pooling"
    with pytest.raises(ValueError, match="disagree"):
        _parse(["--runner", "generate", "--task", "embed"])


@pytest.mark.parametrize(
    "argv",
    [
        ["--dtype", "float64"],
        ["--kv-cache-dtype", "fp4"],
        ["--device", "tpu"],
        ["--block-size", "x"],
        ["--speculative-config", '{"method": "nope"}'],
    ],
)
def test_bad_values_are_argparse_errors(argv):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    with pytest.raises(SystemExit):
        p.parse_args(argv)


def test_fields_without_a_flag_are_python_only():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    flags = {s for a in p._actions for s in a.option_strings}
    assert "--num-gpu-blocks" not in flags and "--num-cpu-blocks" not in flags


def test_a_new_flag_is_one_field():
    @dataclass
    class Knobs:
        policy: str = arg("fcfs", "queue order", choices=("fcfs", "priority"))
        limit: Optional[int] = arg(None, "a limit")
        verbose: bool = arg(False, "say more")
        fast: bool = arg(True, "go fast")
        python_only: int = 7

    p = argparse.ArgumentParser()
    add_dataclass_args(p, Knobs)
    k = dataclass_from_args(Knobs, p.parse_args(["--policy", "priority", "--limit", "5", "--verbose", "--no-fast"]))
    assert k == Knobs(policy="priority", limit=5, verbose=True, fast=False, python_only=7)
    assert dataclass_from_args(Knobs, p.parse_args([])) == Knobs()


def test_a_renamed_flag_a_positional_a_list_and_a_default_read_when_the_parser_is_built():
    read = []

    @dataclass
    class Knobs:
        target: Optional[str] = arg(None, "where", flag="target", nargs="?")
        verbosity: str = arg("info", "how much", flag="--level")
        names: Optional[list] = arg(None, "names", nargs="+", metavar="NAME")
        key: Optional[str] = arg(None, "a key", cli_default=lambda: read.append(1) or "from-env")

    p = argparse.ArgumentParser()
    add_dataclass_args(p, Knobs)
    assert read == [1]  # once, when the flags were made
    assert dataclass_from_args(Knobs, p.parse_args([])) == Knobs(key="from-env")
    k = dataclass_from_args(Knobs, p.parse_args(["here", "--level", "debug", "--names", "a", "b", "--key", "k"]))
    assert k == Knobs(target="here", verbosity="debug", names=["a", "b"], key="k")
    assert "from-env" not in p.format_help()  # a value from the environment is never shown
