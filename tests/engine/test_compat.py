"""engine/compat.py's table of features that do not combine, walked row by row on configs built
by hand (no model files): each pair is refused with a message naming both, each feature alone
passes."""

from __future__ import annotations

import pytest

from pagedllm.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedllm.distributed.kv_transfer.config import KVTransferConfig
from pagedllm.engine.compat import CONFLICTS, check_compatibility

# A 4-layer Llama shape that tensor parallelism 2 can split.
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}
# Gemma 3's sliding and full layers: two KV cache groups.
GEMMA3 = {
    **LLAMA,
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "sliding_window": 16,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
}
# LFM2's short convolutions between attention layers: recurrent state.
LFM2 = {
    **LLAMA,
    "architectures": ["Lfm2ForCausalLM"],
    "model_type": "lfm2",
    "layer_types": ["conv", "full_attention"] * 2,
}


def _base() -> EngineConfig:
    return EngineConfig(
        ModelConfig(model="/none", hf_config=dict(LLAMA), max_model_len=128),
        CacheConfig(),
        SchedulerConfig(max_model_len=128),
    )


def _set(obj, **values):
    for k, v in values.items():
        setattr(obj, k, v)


# Each feature turned on by hand, and a word its refusals must name (the field a user changes).
TURN_ON = {
    "speculative_config": (lambda c: _set(c, speculative_config=SpeculativeConfig("ngram", 2)), "speculative_config"),
    "speculative_config 'draft_model'": (
        lambda c: _set(c, speculative_config=SpeculativeConfig("draft_model", 2, model="self:1")),
        "draft_model",
    ),
    "kv_transfer_config": (
        lambda c: _set(
            c, kv_transfer_config=KVTransferConfig.from_cli({"kv_connector": "ZmqConnector", "kv_role": "kv_producer"})
        ),
        "kv_transfer_config",
    ),
    "enable_lora": (lambda c: _set(c, lora_config=LoRAConfig()), "enable_lora"),
    "async_scheduling": (lambda c: _set(c.scheduler_config, async_scheduling=True), "async_scheduling"),
    "runner 'pooling'": (lambda c: _set(c.model_config, runner="pooling"), "runner"),
    "tensor / pipeline parallelism": (lambda c: _set(c.parallel_config, tensor_parallel_size=2), "parallel"),
    "data_parallel_size > 1": (lambda c: _set(c.parallel_config, data_parallel_size=2), "data_parallel_size"),
    "device 'cuda'": (lambda c: _set(c, device_config=DeviceConfig("cuda", "triton")), "device"),
    "a CPU attention backend": (lambda c: _set(c.device_config, attention_backend="torch"), "attention_backend"),
    "several KV cache groups": (lambda c: _set(c.model_config, hf_config=dict(GEMMA3)), "KV cache groups"),
    "a model with recurrent layers": (lambda c: _set(c.model_config, hf_config=dict(LFM2)), "recurrent layers"),
}

# The pairs that do not combine, written out: a row dropped from the table fails here.
EXPECTED_PAIRS = {
    ("speculative_config", "runner 'pooling'"),
    ("speculative_config", "tensor / pipeline parallelism"),
    ("runner 'pooling'", "tensor / pipeline parallelism"),
    ("runner 'pooling'", "data_parallel_size > 1"),
    ("kv_transfer_config", "tensor / pipeline parallelism"),
    ("kv_transfer_config", "data_parallel_size > 1"),
    ("kv_transfer_config", "runner 'pooling'"),
    ("kv_transfer_config", "several KV cache groups"),
    ("speculative_config 'draft_model'", "several KV cache groups"),
    ("device 'cuda'", "a CPU attention backend"),
    ("device 'cuda'", "tensor / pipeline parallelism"),
    ("enable_lora", "tensor / pipeline parallelism"),
    ("enable_lora", "runner 'pooling'"),
    ("async_scheduling", "speculative_config"),
    ("async_scheduling", "kv_transfer_config"),
    ("async_scheduling", "runner 'pooling'"),
    ("async_scheduling", "tensor / pipeline parallelism"),
    ("a model with recurrent layers", "speculative_config"),
    ("a model with recurrent layers", "tensor / pipeline parallelism"),
    ("a model with recurrent layers", "kv_transfer_config"),
}


def _config(*features: str) -> EngineConfig:
    config = _base()
    for name in features:
        TURN_ON[name][0](config)
    config.validate()  # each config's own fields are fine: what fails is the combination
    return config


def test_the_table_holds_the_expected_pairs():
    assert {(r.feature.name, r.other.name) for r in CONFLICTS} == EXPECTED_PAIRS


@pytest.mark.parametrize("rule", CONFLICTS, ids=lambda r: f"{r.feature.name} + {r.other.name}")
def test_each_pair_is_refused_naming_both(rule):
    with pytest.raises(ValueError) as e:
        check_compatibility(_config(rule.feature.name, rule.other.name))
    assert str(e.value) == rule.message
    for name in (rule.feature.name, rule.other.name):
        assert TURN_ON[name][1] in str(e.value), (name, str(e.value))


@pytest.mark.parametrize("name", sorted(TURN_ON))
def test_each_feature_alone_is_accepted(name):
    check_compatibility(_config(name))


def test_several_features_that_combine_are_accepted():
    # LoRA, async scheduling and data parallelism run together, as do speculation and LoRA.
    check_compatibility(_config("enable_lora", "async_scheduling", "data_parallel_size > 1"))
    check_compatibility(_config("speculative_config", "enable_lora", "data_parallel_size > 1"))


def test_what_the_features_refuse_of_one_request():
    from pagedllm.engine.compat import check_request
    from pagedllm.lora import LoRARequest
    from pagedllm.sampling_params import ParamError, SamplingParams, StructuredOutputsParams

    plain = SamplingParams(max_tokens=4)
    for name in TURN_ON:  # nothing refused of a plain request
        check_request(_config(name), plain)
    refusals = [
        (_config("async_scheduling"), dict(beam_width=2), "beam_width", "beam search is not supported with async"),
        (
            _config("async_scheduling"),
            dict(params=SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"]))),
            "structured_outputs",
            "structured_outputs is not supported with async_scheduling",
        ),
        (
            _config("tensor / pipeline parallelism"),
            dict(params=SamplingParams(prompt_logprobs=1)),
            "prompt_logprobs",
            "prompt_logprobs is not supported with tensor or pipeline parallelism",
        ),
    ]
    for config, kwargs, field, message in refusals:
        with pytest.raises(ParamError, match=message) as e:
            check_request(config, **{"params": plain, **kwargs})
        assert e.value.param == field
    with pytest.raises(ValueError, match="lora_request is not supported with beam search"):
        check_request(_config("enable_lora"), plain, beam_width=2, lora_request=LoRARequest("a", 1, "/none"))
    check_request(_config("enable_lora"), plain, beam_width=1, lora_request=LoRARequest("a", 1, "/none"))
    check_request(_config("runner 'pooling'"), SamplingParams(prompt_logprobs=1), beam_width=2)
