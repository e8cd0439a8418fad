"""The attention backends' registry (attention/backends/registry.py): each name's class is the
backend of that name, lives in its own folder attention/backends/<folder>/ with every folder
registered (one folder a backend), and the CLI and config validation take their choices from it.
MLA is a capability a backend declares: a layer refuses a backend without it."""

import argparse
import importlib
from pathlib import Path

import pytest
import torch

from pagedllm.attention.backends import registry
from pagedllm.attention.backends.abstract import AttentionBackend
from pagedllm.attention.backends.torch_sdpa import TorchSDPABackend
from pagedllm.attention.mla_attention import MLAAttention

BACKENDS_DIR = Path(registry.__file__).parent


def registered_classes():
    for name, entry in registry.BACKENDS.items():
        if name == "triton":
            pytest.importorskip("triton")
        yield name, entry, registry.backend_class(name)


def test_each_backend_is_one_registered_folder():
    folders = {p.name for p in BACKENDS_DIR.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    homes = set()
    for name, entry, cls in registered_classes():
        assert issubclass(cls, AttentionBackend) and cls.name == name
        module = importlib.import_module(cls.__module__)
        home = Path(module.__file__).parent
        assert home.parent == BACKENDS_DIR, f"{name}: {cls.__module__} is not in a backend's folder"
        assert entry.backend_class.split(":")[0] == f"pagedllm.attention.backends.{home.name}"
        homes.add(home.name)
    assert homes == folders  # no folder without its registry line


def test_unknown_name_is_a_value_error():
    with pytest.raises(ValueError, match="attention backend must be one of .*'torch'.*got 'flash'"):
        registry.backend_class("flash")


def test_cli_and_config_read_the_registry():
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.entrypoints.cli import add_engine_args

    assert registry.backend_choices() == ("torch", "triton")  # "cpu" is the selector's alone
    p = argparse.ArgumentParser()
    add_engine_args(p)
    action = next(a for a in p._actions if "--attention-backend" in a.option_strings)
    assert action.choices == ["auto", *registry.backend_choices()]
    with pytest.raises(ValueError, match=r"attention_backend must be one of \('auto', 'torch', 'triton'\), got 'cpu'"):
        EngineArgs(model="random:tiny", attention_backend="cpu").create_engine_config()


def test_mla_is_a_backend_capability():
    for name, _, cls in registered_classes():
        assert cls.supports_mla, name  # every backend today runs MLA layers

    class NoMLA(TorchSDPABackend):
        name = "no-mla"
        supports_mla = False

    with pytest.raises(ValueError, match="the no-mla attention backend does not run MLA layers"):
        MLAAttention(4, 0.1, 32, 16, 8, 16, backend=NoMLA(torch.device("cpu")))
    layer = MLAAttention(4, 0.1, 32, 16, 8, 16, backend=TorchSDPABackend(torch.device("cpu")))
    assert layer.backend.supports_mla
