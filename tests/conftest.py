"""Shared fixtures: the default model is prepared once per run and shared by every test."""
import os

import pytest
import torch

# Without a GPU the Triton kernels run under the interpreter (test_triton_kernels.py,
# test_triton_runner.py). Triton reads this when a kernel is decorated, so it is set before
# any test module is collected, whichever imports the kernels first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    # The workload fuzzers (tests/test_engine_fuzz.py, tests/test_server_fuzz.py): a fixed seed
    # and a bounded case count in CI; scale or replay from the command line.
    group = parser.getgroup("fuzz")
    group.addoption("--fuzz-cases", type=int, default=None,
                    help="engine fuzzer: number of cases (default: the CI count)")
    group.addoption("--fuzz-seed", type=int, default=0, help="fuzzers: the base seed")
    group.addoption("--fuzz-replay", default=None, metavar="GROUP:CASE",
                    help="engine fuzzer: replay one failing case (and the cases before it on its engine)")
    group.addoption("--fuzz-seconds", type=float, default=None,
                    help="server fuzzer: how long to send requests (default: the CI duration)")


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
