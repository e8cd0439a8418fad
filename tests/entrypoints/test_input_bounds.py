"""Bounded input before work: a body over --max-request-body-bytes is refused
with 413 before it is read whole; a prompt (or chat messages) with more characters than
max_model_len tokens could hold is refused before the tokenizer runs; n, best_of, logprobs, the
stop list, stop_token_ids and logit_bias are bounded, offline (ValueError naming the field) and
in the server (400 naming it). A real `pagedllm serve` of the tiny random model on 127.0.0.1."""

from __future__ import annotations

import json
import pickle
import re
import socket

import httpx
import openai
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    ParamError,
)
from server_utils import TINY, TINY_CHAT_TEMPLATE, TINY_SERVER_MAX_BODY_BYTES, TINY_SERVER_MAX_MODEL_LEN, assert_error

MODEL = TINY
MAX_MODEL_LEN = TINY_SERVER_MAX_MODEL_LEN  # the shared tiny server's (conftest.py)
LIMIT = TINY_SERVER_MAX_BODY_BYTES  # its --max-request-body-bytes
# The tiny model's word-level vocabulary: "w5" ... "w511" and "<unk>": 5 characters at most.
MAX_CHARS = MAX_MODEL_LEN * 5
TEMPLATE = TINY_CHAT_TEMPLATE

CLIENT_TIMEOUT = 30  # seconds: the tiny model answers fast


@pytest.fixture(scope="module")
def server(tiny_shared_server):
    return tiny_shared_server


def _raw_exchange(port: int, head: bytes, body_parts=(), timeout: float = 30.0) -> bytes:
    """Send a request head and body parts on a plain socket, never finishing the body, and read
    the reply until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head)
        for part in body_parts:
            s.sendall(part)
        reply = b""
        while True:
            data = s.recv(65536)
            if not data:
                return reply
            reply += data


def _check_413(reply: bytes) -> dict:
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 "), reply[:300]
    err = json.loads(body)["error"]
    assert err["code"] == "request_too_large" and f"limit of {LIMIT} bytes" in err["message"], err
    return err


# ------------------------------------------------------------------ 413 before reading the body
@pytest.mark.timeout(60)
def test_body_over_the_limit_413(server):
    """httpx, a whole body: with a Content-Length, and chunked (no length) streaming past the
    limit; the chunked one is refused before the client could send it all. A body within the
    limit, chunked or not, is served."""
    big = json.dumps({"model": MODEL, "prompt": "w5 " * (LIMIT // 3), "max_tokens": 2}).encode()
    assert len(big) > LIMIT
    r = httpx.post(
        server.url + "/v1/completions", content=big, headers={"Content-Type": "application/json"}, timeout=30
    )
    err = assert_error(r, 413, "request_too_large")
    assert f"({len(big)} bytes)" in err["message"] and "--max-request-body-bytes" in err["message"], err

    sent = []
    total = 1024  # 64 MiB in 64 KiB chunks, far more than socket buffers hold

    def chunks():
        for _ in range(total):
            sent.append(1)
            yield b" " * (64 << 10)

    r = httpx.post(
        server.url + "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}, timeout=30
    )
    assert_error(r, 413, "request_too_large")
    assert len(sent) < total, "the server read the whole chunked body before refusing it"

    ok = json.dumps({"model": MODEL, "prompt": "w5 w6", "max_tokens": 2}).encode()
    for content in (ok, iter([ok[:7], ok[7:]])):  # bytes: Content-Length; an iterator: chunked
        r = httpx.post(
            server.url + "/v1/completions", content=content, headers={"Content-Type": "application/json"}, timeout=30
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


@pytest.mark.timeout(60)
def test_413_comes_before_the_body(server):
    """Raw sockets: a declared length over the limit is refused with no body sent at all; a
    chunked body is refused once it passes the limit though it never ends."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    err = _check_413(_raw_exchange(server.port, head + b"Content-Length: %d\r\n\r\n" % (10**12)))
    assert f"({10**12} bytes)" in err["message"]
    chunk = b"%x\r\n%s\r\n" % (16 << 10, b"x" * (16 << 10))
    _check_413(
        _raw_exchange(server.port, head + b"Transfer-Encoding: chunked\r\n\r\n", [chunk] * (LIMIT // (16 << 10) + 1))
    )
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# ------------------------------------------------------------------ characters before tokens
@pytest.mark.timeout(60)
def test_long_prompt_refused_before_tokenizing_offline():
    """The message counts characters, not tokens: the check ran before the tokenizer."""
    llm = LLM(MODEL, max_model_len=MAX_MODEL_LEN, kv_cache_memory=16 << 20)
    assert llm.llm_engine.processor.max_token_chars == 5
    text = "w5 " * (MAX_CHARS // 3 + 1)
    with pytest.raises(
        ValueError,
        match=rf"prompt has {len(text)} characters, more than max_model_len "
        rf"\({MAX_MODEL_LEN}\) tokens of at most 5 characters each can hold "
        rf"\({MAX_CHARS}\)",
    ) as e:
        llm.generate(text, SamplingParams(max_tokens=2), use_tqdm=False)
    assert e.value.param == "prompt"
    with pytest.raises(ValueError, match="messages has .* characters"):
        llm.chat(
            [{"role": "user", "content": text[: MAX_CHARS // 2]}, {"role": "user", "content": text}],
            SamplingParams(max_tokens=2),
            chat_template=TEMPLATE,
            use_tqdm=False,
        )
    # At the bound the tokenizer runs, and the token count decides.
    edge = ("w55 " * (MAX_CHARS // 4))[:MAX_CHARS]
    with pytest.raises(ValueError) as e:
        llm.generate(edge, SamplingParams(max_tokens=2), use_tqdm=False)
    assert "characters" not in str(e.value) and "tokens" in str(e.value)


@pytest.mark.timeout(60)
def test_long_prompt_refused_before_tokenizing_server(server, client):
    text = "w5 " * (MAX_CHARS // 3 + 1)
    for kwargs in (
        {"prompt": text},
        {"prompt": ["w5 w6", text]},
        {"prompt": text, "extra_body": {"add_special_tokens": False}},
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, max_tokens=2, **kwargs)
        assert e.value.body["param"] == "prompt" and f"prompt has {len(text)} characters" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": text}])
    assert e.value.body["param"] == "messages" and f"messages has {len(text)} characters" in e.value.body["message"]
    for body in ({"prompt": text}, {"messages": [{"role": "user", "content": text}]}):
        err = assert_error(httpx.post(server.url + "/tokenize", json=body, timeout=30), 400)
        assert "characters" in err["message"], err


# ------------------------------------------------------------------ bounded fields
def _stops(n, chars=2):
    return [f"{i:0{chars}d}" for i in range(n)]


# (the field as the API names it, a request over the bound, one at the bound, the allowed range in words)
_BOUNDS = [
    ("n", {"n": MAX_N + 1}, {"n": MAX_N}, f"[1, {MAX_N}]"),
    ("best_of", {"best_of": MAX_N + 1}, {"best_of": MAX_N}, f"[n (1), {MAX_N}]"),
    ("logprobs", {"logprobs": MAX_LOGPROBS + 1}, {"logprobs": MAX_LOGPROBS}, f"[0, {MAX_LOGPROBS}]"),
    (
        "stop",
        {"stop": _stops(MAX_STOP_STRINGS + 1)},
        {"stop": _stops(MAX_STOP_STRINGS)},
        f"at most {MAX_STOP_STRINGS} strings",
    ),
    (
        "stop",
        {"stop": _stops(1, MAX_STOP_STRING_CHARS + 1)},
        {"stop": _stops(1, MAX_STOP_STRING_CHARS)},
        f"at most {MAX_STOP_STRING_CHARS} characters",
    ),
    (
        "stop_token_ids",
        {"stop_token_ids": [3] * (MAX_STOP_TOKEN_IDS + 1)},
        {"stop_token_ids": [3] * MAX_STOP_TOKEN_IDS},
        f"at most {MAX_STOP_TOKEN_IDS} token ids",
    ),
    (
        "logit_bias",
        {"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}},
        {"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS)}},
        f"at most {MAX_LOGIT_BIAS} entries",
    ),
]


def _offline(fields: dict) -> dict:
    """The request's fields as SamplingParams takes them (logit_bias keyed by int)."""
    return {k: ({int(t): b for t, b in v.items()} if k == "logit_bias" else v) for k, v in fields.items()}


@pytest.mark.parametrize("param, bad, ok, allowed", _BOUNDS)
def test_bounds_offline(param, bad, ok, allowed):
    with pytest.raises(ValueError, match=rf"^{param} must be .*{re.escape(allowed)}") as e:
        SamplingParams(**_offline(bad))
    assert isinstance(e.value, ParamError) and e.value.param == param
    again = pickle.loads(pickle.dumps(e.value))  # it can cross to another process
    assert (again.param, str(again)) == (param, str(e.value))
    SamplingParams(**_offline(ok))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("param, bad, ok, allowed", _BOUNDS)
def test_bounds_server_400(client, param, bad, ok, allowed):
    own = {k: v for k, v in bad.items() if k != "stop_token_ids"}  # the openai client's own fields
    extra = {k: v for k, v in bad.items() if k == "stop_token_ids"}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="w5 w6", max_tokens=2, extra_body=extra, **own)
    body = e.value.body
    assert e.value.status_code == 400 and body["param"] == param and allowed in body["message"], body


@pytest.mark.timeout(60)
def test_chat_and_prompt_list_bounds_server_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "w5"}],
            max_tokens=2,
            logprobs=True,
            top_logprobs=MAX_LOGPROBS + 1,
        )
    assert e.value.body["param"] == "top_logprobs"
    assert e.value.body["message"].startswith(f"top_logprobs must be None or an integer in [0, {MAX_LOGPROBS}]")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "w5"}], max_tokens=2, n=MAX_N + 1
        )
    assert e.value.body["param"] == "n"
    from pagedllm.entrypoints.openai.protocol import MAX_PROMPTS

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=["w5"] * (MAX_PROMPTS + 1), max_tokens=1)
    assert e.value.body["param"] == "prompt" and f"at most {MAX_PROMPTS} prompts" in e.value.body["message"]
    # within every bound, the server still serves
    r = client.completions.create(
        model=MODEL,
        prompt="w5 w6",
        max_tokens=2,
        n=2,
        best_of=3,
        logprobs=MAX_LOGPROBS,
        stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)],
    )
    assert len(r.choices) == 2


def test_development_routes_off_by_default(server):
    """POST /reset_prefix_cache exists only with PAGEDLLM_SERVER_DEV_MODE=1 (as vLLM's dev mode)."""
    assert httpx.post(server.url + "/reset_prefix_cache", timeout=30).status_code == 404
