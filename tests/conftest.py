"""Shared fixtures: the default model is prepared once per run and shared by every test."""
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "model: needs the real default model (slower)")


@pytest.fixture(scope="session")
def model_dir():
    from pagedllm.models.download import ensure_default_model
    return str(ensure_default_model(progress=False))


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def hf_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
