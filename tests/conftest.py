"""Shared fixtures: the default model is prepared once per run and shared by every test.
Tests that use it are marked `model` here (`make test-fast` deselects them), and Hypothesis
runs derandomized in CI."""

import os

import pytest
import torch
from hypothesis import settings

from pagedllm.csrc.build import runnable_isas

# Without a GPU the Triton kernels run under the interpreter (test_triton_kernels.py,
# test_triton_runner.py). Triton reads this when a kernel is decorated, so it is set before
# any test module is collected, whichever imports the kernels first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The tests' Ray clusters listen on loopback only (Ray reads this at import; otherwise it binds to
# the default route's address even when asked for 127.0.0.1); the servers the tests start inherit it.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


# CI (`.ci/run` sets CI=true) draws the same examples every run: a red build replays, and a
# green one is not the luck of the draw. Locally each run keeps exploring new examples. (Recent
# Hypothesis versions have a built-in "ci" profile like it; ours does not depend on the version.)
settings.register_profile("pagedllm-ci", derandomize=True, database=None, deadline=None, print_blob=True)
if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
    settings.load_profile("pagedllm-ci")

# Fixtures that load the default model: a test using one (directly or through another
# fixture) is a `model` test. A test reaching the model another way is marked by hand.
MODEL_FIXTURES = {"model_dir", "tokenizer", "hf_model"}


def pytest_addoption(parser):
    # The workload fuzzers (tests/engine/test_engine_fuzz.py, tests/entrypoints/test_server_fuzz.py): a fixed seed
    # and a bounded case count in CI; scale or replay from the command line.
    group = parser.getgroup("fuzz")
    group.addoption(
        "--fuzz-cases", type=int, default=None, help="engine fuzzer: number of cases (default: the CI count)"
    )
    group.addoption("--fuzz-seed", type=int, default=0, help="fuzzers: the base seed")
    group.addoption(
        "--fuzz-replay",
        default=None,
        metavar="GROUP:CASE",
        help="engine fuzzer: replay one failing case (and the cases before it on its engine)",
    )
    group.addoption(
        "--fuzz-seconds",
        type=float,
        default=None,
        help="server fuzzer: send requests for this long (default: the CI count of requests)",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "model: needs the real default model (slower)")
    config.addinivalue_line("markers", "slow: CI runs it; `make test-fast` leaves it out")
    config.addinivalue_line("markers", "stops_server: stops the session's shared server (run last)")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)
    # A test that stops a shared server runs after every other test (which may share it).
    items.sort(key=lambda item: item.get_closest_marker("stops_server") is not None)  # stable


@pytest.fixture(params=runnable_isas())
def cpu_isa(request, monkeypatch):
    """Each build of the C++ kernels this CPU runs (csrc/build.py VARIANTS: avx512 and avx2 on an
    AVX-512 machine): a test using it runs once per variant, its kernels from that build."""
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", request.param)
    return request.param


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


# ---------------------------------------------------------------- shared servers (tests/server_utils.py)
@pytest.fixture(scope="session")
def default_server(model_dir):
    """`pagedllm serve` of the default model, shared by test_server.py and test_server_beam.py."""
    from server_utils import DEFAULT_SERVER_ARGS, DEFAULT_SERVER_ENV, RemoteServer

    srv = RemoteServer(DEFAULT_SERVER_ARGS, env=DEFAULT_SERVER_ENV)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(request, server):
    """The official openai client on the module's `server` fixture (a module's CLIENT_TIMEOUT, in
    seconds, overrides the client's default)."""
    return server.client(
        **({"timeout": request.module.CLIENT_TIMEOUT} if hasattr(request.module, "CLIENT_TIMEOUT") else {})
    )


@pytest.fixture(scope="module")
def model(client):
    """The id the module's server serves its model under (its one /v1/models entry)."""
    return client.models.list().data[0].id


@pytest.fixture(scope="session")
def tiny_shared_server():
    """`pagedllm serve` of the tiny random model, shared by test_server_logprobs.py,
    test_server_sampling.py and test_input_bounds.py."""
    from server_utils import RESPONSES_STORE_ON, TINY_SERVER_MAX_BODY_BYTES, TINY_SERVER_MAX_MODEL_LEN, tiny_server

    srv = tiny_server(
        TINY_SERVER_MAX_MODEL_LEN, "--max-request-body-bytes", str(TINY_SERVER_MAX_BODY_BYTES), env=RESPONSES_STORE_ON
    )
    yield srv
    srv.close()


@pytest.fixture(scope="session")
def structured_server(tmp_path_factory):
    """`pagedllm serve` of a tiny random-weight model with a small byte-level tokenizer (so that
    JSON, regexes and tool calls can be spelled), Hermes tool calls and the qwen3 reasoning
    parser: shared by tests/structured_output/ and tests/entrypoints/test_tools*.py."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "structured_output"))
    from server_utils import RESPONSES_STORE_ON, RemoteServer
    from tiny_chat_model import make_tiny_chat_model

    model = make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
    srv = RemoteServer(
        [
            "--model",
            str(model),
            "--max-model-len",
            "1024",
            "--max-num-seqs",
            "128",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--reasoning-parser",
            "qwen3",
        ],
        env=RESPONSES_STORE_ON,
    )
    yield srv
    srv.close()
