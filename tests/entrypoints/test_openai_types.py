"""Every response body of the OpenAI endpoints parsed by the `openai` package's own pydantic types
in strict mode (the client itself builds them without validation, so a wrong type or a missing
field would pass through it unseen), and no field the type does not know but vLLM's extras."""

from __future__ import annotations

import json

import httpx
import pytest
from pydantic import BaseModel

from server_utils import TINY
from engine.test_logprobs import tiny_dir  # noqa: F401 (fixture)

# Fields pagedllm adds, as vLLM does: not in OpenAI's types.
VLLM_EXTRAS = {
    "stop_reason",
    "prompt_logprobs",
    "root",
    "parent",
    "max_model_len",
    "reasoning_content",
    "kv_transfer_params",
}
MESSAGES = [{"role": "user", "content": "w12 w400 w33"}]


def completion_types():
    """openai's Completion with the two things its types leave out although OpenAI's API sends
    them: an echoed prompt's first token has null logprobs (nothing precedes it), and a stream
    chunk's finish_reason is null until the last (the package reuses Completion for chunks)."""
    from typing import Dict, List, Literal, Optional

    from openai.types import Completion, CompletionChoice
    from openai.types.completion_choice import Logprobs

    class EchoLogprobs(Logprobs):
        token_logprobs: Optional[List[Optional[float]]] = None
        top_logprobs: Optional[List[Optional[Dict[str, float]]]] = None

    class Choice(CompletionChoice):
        logprobs: Optional[EchoLogprobs] = None

    class ChunkChoice(Choice):
        finish_reason: Optional[Literal["stop", "length", "content_filter"]] = None

    class EchoCompletion(Completion):
        choices: List[Choice]

    class CompletionChunk(Completion):
        choices: List[ChunkChoice]

    return EchoCompletion, CompletionChunk


@pytest.fixture(scope="module")
def server(tiny_dir, tiny_shared_server):
    return tiny_shared_server


def unknown_fields(m: BaseModel, where: str = "") -> list[str]:
    """The fields of m (and of the models inside it) that its type does not declare."""
    out = [f"{where}.{k}" for k in (m.model_extra or {}) if k not in VLLM_EXTRAS]
    for name in type(m).model_fields:
        v = getattr(m, name)
        for i, item in enumerate(v if isinstance(v, list) else [v]):
            if isinstance(item, BaseModel):
                out += unknown_fields(item, f"{where}.{name}[{i}]")
    return out


def parse(type_, body: dict):
    obj = type_.model_validate(body, strict=True)
    assert unknown_fields(obj) == [], (type_.__name__, body)
    return obj


def _post(server, path: str, body: dict) -> httpx.Response:
    r = httpx.post(server.url + path, json={"model": TINY, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r


def _events(r: httpx.Response) -> list[dict]:
    lines = [ln[len("data: ") :] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]", r.text
    return [json.loads(ln) for ln in lines[:-1]]


@pytest.mark.timeout(120)
def test_responses_parse_as_openai_types(server):
    from openai.types import Model
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    Completion, CompletionChunk = completion_types()

    for body in (
        {"prompt": "w5 w6", "max_tokens": 3, "n": 2, "logprobs": 2},
        {"prompt": [5, 6, 7], "max_tokens": 0, "echo": True, "logprobs": 1},
        {"prompt": [5, 6, 7], "max_tokens": 2, "prompt_logprobs": 1},
    ):
        c = parse(Completion, _post(server, "/v1/completions", body).json())
        assert c.usage is not None and c.choices
    for ev in _events(
        _post(
            server,
            "/v1/completions",
            {
                "prompt": "w5",
                "max_tokens": 3,
                "stream": True,
                "echo": True,
                "logprobs": 1,
                "stream_options": {"include_usage": True},
            },
        )
    ):
        parse(CompletionChunk, ev)
    chat = parse(
        ChatCompletion,
        _post(
            server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}
        ).json(),
    )
    assert chat.choices[0].logprobs.content
    events = _events(
        _post(
            server,
            "/v1/chat/completions",
            {
                "messages": MESSAGES,
                "max_tokens": 3,
                "stream": True,
                "logprobs": True,
                "stream_options": {"include_usage": True},
            },
        )
    )
    for ev in events:
        parse(ChatCompletionChunk, ev)
    assert events[-1]["usage"]["completion_tokens"] == 3
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list" and [parse(Model, m).id for m in models["data"]] == [TINY]
    assert parse(Model, httpx.get(server.url + f"/v1/models/{TINY}").json()).id == TINY
