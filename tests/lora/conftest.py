"""The LoRA tests' models and adapters: a tiny random-weight Llama (transformers' classes) and
adapters made by peft on it, once per session."""

import pytest


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from pagedllm.models.random_model import make_random_model

    return str(make_random_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", initializer_range=0.2))


# (name, make_adapter options): ranks 4-16, subsets of the projections, rsLoRA.
ADAPTERS = [
    ("all-r8", dict(r=8)),
    ("qvdown-r4-rs", dict(r=4, targets=["q_proj", "v_proj", "down_proj"], use_rslora=True)),
    ("kogu-r16", dict(r=16, targets=["k_proj", "o_proj", "gate_proj", "up_proj"], lora_alpha=8)),
    ("attn-r2", dict(r=2, targets=["q_proj", "k_proj", "v_proj", "o_proj"])),
    ("mlp-r6", dict(r=6, targets=["gate_proj", "up_proj", "down_proj"])),
    ("all-r16-rs", dict(r=16, use_rslora=True)),
]


@pytest.fixture(scope="session")
def tiny_adapters(tiny_dir, tmp_path_factory):
    """[LoRARequest] of the six adapters above, ids 1..6."""
    from lora_utils import make_adapter

    from pagedllm.lora import LoRARequest

    root = tmp_path_factory.mktemp("adapters")
    return [
        LoRARequest(name, i + 1, make_adapter(tiny_dir, str(root / name), seed=i + 1, **kw))
        for i, (name, kw) in enumerate(ADAPTERS)
    ]


@pytest.fixture(scope="session")
def tiny_references(tiny_dir, tiny_adapters):
    """lora_int_id (0: the base model) -> transformers' model with that adapter merged by PEFT."""
    import torch
    from lora_utils import merged_model
    from transformers import AutoModelForCausalLM

    refs = {0: AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()}
    refs.update({a.lora_int_id: merged_model(tiny_dir, a.lora_path) for a in tiny_adapters})
    return refs
