"""A model directory -> its ModelConfig (models/model_config_loader.py): the values read from a
config.json written here by hand, a vision-language config flattened to its text model, and a
ValueError naming the field for each bad input (messages written out by hand)."""

from __future__ import annotations

import json

import pytest

from pagedllm.models.model_config_loader import model_config_from_dir, set_quantization

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_size": 64,
    "vocab_size": 100,
    "max_position_embeddings": 128,
}


def _dir(tmp_path, config, *extra_files):
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name in extra_files:
        (tmp_path / name).write_text("{}")
    return str(tmp_path)


def test_a_directory_gives_its_config_values(tmp_path):
    mc = model_config_from_dir(_dir(tmp_path, LLAMA), dtype="bfloat16", seed=7)
    assert (mc.model, mc.dtype, mc.seed, mc.max_model_len) == (str(tmp_path), "bfloat16", 7, 128)
    assert (mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.hidden_size, mc.vocab_size) == (2, 4, 2, 64, 100)
    assert mc.quantization is None and mc.runner == "generate"
    assert model_config_from_dir(str(tmp_path), max_model_len=32).max_model_len == 32


def test_max_model_len_defaults_to_2048_without_max_position_embeddings(tmp_path):
    config = {k: v for k, v in LLAMA.items() if k != "max_position_embeddings"}
    assert model_config_from_dir(_dir(tmp_path, config)).max_model_len == 2048


def test_a_vision_language_config_reads_as_its_text_model(tmp_path):
    config = {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "vision_config": {"hidden_size": 8},
        "text_config": {**LLAMA, "architectures": ["LlamaForCausalLM"]},
    }
    mc = model_config_from_dir(_dir(tmp_path, config))
    assert mc.hf_config["architectures"] == ["Idefics3ForConditionalGeneration"]
    assert mc.hf_config["multimodal_config"] == config
    assert (mc.num_layers, mc.hidden_size, mc.max_model_len) == (2, 64, 128)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"dtype": "float64"}, "dtype must be one of auto, float32, bfloat16, float16, got 'float64'"),
        (
            {"max_model_len": 129},
            "max_model_len must be an integer in [1, 128] (the model's max_position_embeddings), got 129",
        ),
        (
            {"max_model_len": 0},
            "max_model_len must be an integer in [1, 128] (the model's max_position_embeddings), got 0",
        ),
    ],
)
def test_a_bad_argument_is_refused(tmp_path, kw, message):
    with pytest.raises(ValueError) as e:
        model_config_from_dir(_dir(tmp_path, LLAMA), **kw)
    assert str(e.value) == message


def test_an_unknown_architecture_is_refused(tmp_path):
    path = _dir(tmp_path, {**LLAMA, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(
        ValueError,
        match=r"architecture \['GPT2LMHeadModel'\] in '.*config.json' is not "
        r"supported; supported: LlamaForCausalLM, ",
    ):
        model_config_from_dir(path)


def test_a_missing_directory_or_config_json_is_refused(tmp_path):
    with pytest.raises(ValueError) as e:
        model_config_from_dir(str(tmp_path / "none"))
    assert str(e.value) == f"model path '{tmp_path / 'none'}' does not exist or is not a directory"
    with pytest.raises(ValueError) as e:
        model_config_from_dir(str(tmp_path))
    assert str(e.value) == (
        f"model directory '{tmp_path}' has no config.json; an HF-format model directory is required"
    )


def test_quantization_is_checked_and_a_gguf_directory_is_served_as_gguf(tmp_path):
    (tmp_path / "plain").mkdir()
    mc = model_config_from_dir(_dir(tmp_path / "plain", LLAMA))
    set_quantization(mc, "int4", 64, "cpu")
    assert (mc.quantization, mc.quantization_group_size) == ("int4", 64)
    with pytest.raises(ValueError, match="quantization must be one of .*got 'nf4'"):
        set_quantization(mc, "nf4", None, "cpu")
    (tmp_path / "gguf").mkdir()
    gguf = model_config_from_dir(_dir(tmp_path / "gguf", LLAMA, "gguf.json"))
    set_quantization(gguf, None, None, "cpu")
    assert gguf.quantization == "gguf"
    with pytest.raises(ValueError) as e:
        set_quantization(gguf, "int8", None, "cpu")
    assert str(e.value) == "quantization 'int8': a GGUF model is served as it is (quantization gguf)"
