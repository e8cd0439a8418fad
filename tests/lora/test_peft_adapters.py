"""Adapter directories in PEFT's format (lora/peft_helper.py, lora_model.py): what is read, how
it is scaled and sliced into our fused layers, and a ValueError naming what is refused."""

import json
import os

import pytest
import torch
from lora_utils import make_adapter
from safetensors.torch import load_file

from pagedllm.lora import LoRARequest
from pagedllm.lora.lora_model import LoRAModel
from pagedllm.lora.peft_helper import PEFTHelper


def _hf(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def test_loaded_weights_are_scaled_and_keyed_by_fused_layer(tiny_dir, tiny_adapters):
    hf = _hf(tiny_dir)
    lora = tiny_adapters[1]  # q, v, down; r 4, rsLoRA, alpha 16
    model = LoRAModel.from_local_checkpoint(lora, hf, max_lora_rank=16)
    raw = load_file(os.path.join(lora.lora_path, "adapter_model.safetensors"))
    scale = 16 / 4**0.5  # rsLoRA: alpha / sqrt(r)
    qkv = model.weights["layers.1.self_attn.qkv_proj"]
    assert sorted(qkv) == [0, 2]  # q and v; no k
    a, b = qkv[2]
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_{}.weight"
    assert torch.equal(a, raw[key.format("A")])
    torch.testing.assert_close(b, raw[key.format("B")] * scale)
    assert sorted(model.weights["layers.0.mlp.down_proj"]) == [0]
    assert "layers.0.mlp.gate_up_proj" not in model.weights
    assert model.rank == 4


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(use_dora=True), "DoRA"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(bias="lora_only"), "bias"),
        (dict(targets=["embed_tokens"]), "embed_tokens"),
        (dict(targets=["lm_head"]), "lm_head"),
        (dict(r=32), "max_lora_rank"),
    ],
)
def test_unsupported_adapters_are_refused_by_name(tiny_dir, tmp_path, options, message):
    path = make_adapter(tiny_dir, str(tmp_path / "a"), seed=0, **options)
    with pytest.raises(ValueError, match=message):
        PEFTHelper.from_local_dir(path, _hf(tiny_dir), max_lora_rank=16)


def test_bad_directories_are_refused(tiny_dir, tmp_path, tiny_adapters):
    hf = _hf(tiny_dir)
    with pytest.raises(ValueError, match="not a directory"):
        PEFTHelper.from_local_dir(str(tmp_path / "missing"), hf, 16)
    pickled = make_adapter(tiny_dir, str(tmp_path / "pickled"), seed=0)
    os.rename(os.path.join(pickled, "adapter_model.safetensors"), os.path.join(pickled, "adapter_model.bin"))
    with pytest.raises(ValueError, match="pickled weights are never loaded"):
        PEFTHelper.from_local_dir(pickled, hf, 16)
    other = dict(hf, hidden_size=64)  # an adapter of another base model: shapes differ
    with pytest.raises(ValueError, match="shape"):
        PEFTHelper.from_local_dir(tiny_adapters[0].lora_path, other, 16)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, tiny_adapters[0].lora_path)
