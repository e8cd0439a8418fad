"""The quantization registry (models/layers/quantization/registry.py) is the one list of
methods: the CLI's and the benches' choices are its names, every line names a class that
builds its config, and a checkpoint's own quantization (config.json) is found through it."""

import argparse

import pytest

from pagedllm.models.layers.quantization.registry import (
    METHODS,
    checkpoint_quant_config,
    get_quant_config,
    method_class,
    quantization_choices,
    takes_group_size,
)


def test_every_line_names_a_class_with_the_protocol():
    assert set(METHODS) == {"int8", "int4", "gguf", "fp8"}
    for name in METHODS:
        cls = method_class(name)
        assert cls.name == name and callable(cls.from_quant_args)


def test_choices_are_the_registry_names():
    assert quantization_choices() == ["int8", "int4", "gguf"]  # fp8 is read from the checkpoint
    from pagedllm.entrypoints.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for cmd in ("generate", "serve"):
        q = next(a for a in sub.choices[cmd]._actions if a.dest == "quantization")
        assert list(q.choices) == quantization_choices(), cmd
    from pagedllm.benchmarks.perplexity import QUANTIZATIONS

    assert list(QUANTIZATIONS) == quantization_choices()


def test_configs_by_name():
    assert get_quant_config(None) is None
    assert get_quant_config("int4").group_size == 32 and get_quant_config("int4", 64).group_size == 64
    assert get_quant_config("int8").group_size == 32 and get_quant_config("int8", -1).group_size is None
    assert takes_group_size("int8") and takes_group_size("int4") and not takes_group_size("gguf")


def test_checkpoint_quantization_from_config_json():
    assert checkpoint_quant_config({}) is None
    assert checkpoint_quant_config({"quantization_config": {"quant_method": "gptq"}}) is None  # not ours: as before
    fp8 = checkpoint_quant_config({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 32]}})
    assert fp8.name == "fp8" and fp8.block == (64, 32)
    with pytest.raises(ValueError, match="only fp8 e4m3 weights"):
        checkpoint_quant_config({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}})
