"""The command line as a user runs it (subprocesses): `pagedllm generate` (float32 and
`--dtype float16`, plain and `--chat-template`) and `pagedllm chat` (stdin) against transformers'
greedy output on the same weights, and `pagedllm download` of the default model."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from greedy_utils import hf_greedy
from server_utils import REPO, TINY

sys.path.insert(0, str(Path(__file__).parent.parent / "structured_output"))
from tiny_chat_model import make_tiny_chat_model  # noqa: E402

MAX_TOKENS = 6


def cli(*args: str, stdin: str = "") -> str:
    r = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", *args],
        input=stdin,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stdout


def _reference(path, dtype, prompt_ids) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and top-2 logit gaps."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    ((out, gaps),) = hf_greedy(hf, [prompt_ids], MAX_TOKENS)
    return out, gaps


def assert_greedy_equal(ours: list[int], ref: list[int], gaps: list[float], tie: float) -> None:
    """Equal token for token; a first difference only where the reference's top two are within
    `tie` (two implementations may round a near-tie differently; the texts then part)."""
    for j, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            assert gaps[j] < tie, (ours, ref, j, gaps[j])
            return
    assert len(ours) == len(ref), (ours, ref)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype, tie", [("float32", 1e-4), ("float16", 2e-2)])
def test_generate(dtype, tie):
    """random:tiny's word-level tokenizer: "w5" is id 5, so the printed text is the token ids."""
    from pagedllm.models.random_model import random_model_dir

    out = cli(
        "generate",
        "--model",
        TINY,
        "--dtype",
        dtype,
        "--max-tokens",
        str(MAX_TOKENS),
        "--temperature",
        "0",
        "w5 w17 w300",
        "w9 w9 w120 w7",
    )
    blocks = out.strip().split("\n\n")
    assert len(blocks) == 2, out
    for block, prompt in zip(blocks, ([5, 17, 300], [9, 9, 120, 7])):
        head, text, tail = block.split("\n")
        assert head == f"### {' '.join(f'w{i}' for i in prompt)!r}"
        ids = [int(w[1:]) for w in text.split()]
        assert_greedy_equal(ids, *_reference(random_model_dir(TINY), getattr(torch, dtype), prompt), tie)
        assert tail == f"[{MAX_TOKENS} tokens, finish_reason=length]"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


def _chat_reference(model, conversation) -> str:
    """The reply transformers' greedy generate gives to the conversation through the template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    ids = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False)
    out, gaps = _reference(model, torch.float32, list(ids))
    assert min(gaps) > 1e-4, "a numerical tie in the reference: choose other words"
    return tok.decode(out, skip_special_tokens=True)


@pytest.mark.timeout(600)
def test_chat_and_generate_with_the_template(chat_model):
    """Two turns of `pagedllm chat` (the first reply goes back into the history), and
    `pagedllm generate --chat-template` (each prompt as a user message)."""
    kw = ["--model", str(chat_model), "--max-tokens", str(MAX_TOKENS), "--temperature", "0"]
    out = cli("chat", *kw, "--system", "Be brief.", stdin="Hello there\nAnd the weather?\n\n")
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    first = _chat_reference(chat_model, history)
    history += [{"role": "assistant", "content": first}, {"role": "user", "content": "And the weather?"}]
    second = _chat_reference(chat_model, history)
    assert out == f"pagedllm chat: type a message, an empty line or Ctrl-D to quit.\n> {first}\n> {second}\n> "
    out = cli("generate", *kw, "--chat-template", "Hello there")
    reply = _chat_reference(chat_model, [{"role": "user", "content": "Hello there"}])
    assert out.startswith(f"### 'Hello there'\n{reply}\n["), (out, reply)


@pytest.mark.model
@pytest.mark.timeout(600)
def test_download_is_idempotent(model_dir):
    """The default model, already built (the session's fixture): the command prints its directory."""
    assert cli("download").strip().splitlines()[-1] == model_dir
    assert (Path(model_dir) / "config.json").is_file()
