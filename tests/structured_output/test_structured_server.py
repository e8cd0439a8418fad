"""Structured output through the server with the official openai client: pydantic models
(`chat.completions.parse`, streaming too), regex / choice / grammar, the reasoning parser, and
invalid specs as 400s naming the field. The model has random weights: validity comes from the
grammar alone."""

import asyncio
import json
import re

import jsonschema
import pytest
from openai.lib._parsing._completions import type_to_response_format_param
from schemas import MODELS
from server_utils import assert_error

import httpx

SEEDS = range(5)
MSG = [{"role": "user", "content": "Answer in JSON."}]
ARITH = r'''
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= num | "(" num (("+" | "-" | "*") num)* ")"
num ::= [1-9] [0-9]?
'''


@pytest.fixture(scope="module")
def server(structured_server):
    return structured_server


def _schema(model):
    return type_to_response_format_param(model)["json_schema"]["schema"]


async def _parse_all(server):
    """Every model x seed, whole and streamed, all at once (one batch: the suite's time)."""
    client = server.async_client(timeout=300)
    name = (await client.models.list()).data[0].id

    async def one(model, seed, stream):
        kw = dict(model=name, messages=MSG, response_format=model, temperature=1.0, seed=seed, max_tokens=300)
        if not stream:
            r = await client.chat.completions.parse(**kw)
        else:
            async with client.chat.completions.stream(**kw) as s:
                r = await s.get_final_completion()
        c = r.choices[0]
        return model, stream, c.message.content, c.message.parsed, c.finish_reason

    try:
        return await asyncio.gather(*(one(m, s, stream) for m in MODELS for s in SEEDS for stream in (False, True)))
    finally:
        await client.close()


def server_model(server):
    return server.client().models.list().data[0].id


@pytest.mark.timeout(600)  # the first to run starts the shared server
def test_parse_pydantic_models(server):
    """chat.completions.parse (and .stream) at temperature 1.0: 20 models x 5 seeds, 100 % valid."""
    results = asyncio.run(_parse_all(server))
    assert len(results) == 200
    for model, stream, text, parsed, finish in results:
        assert finish == "stop", (model.__name__, stream, text)
        assert isinstance(parsed, model), (model.__name__, stream, text)
        jsonschema.validate(json.loads(text), _schema(model))


@pytest.mark.timeout(600)  # the first to run starts the shared server
def test_regex_choice_grammar_always_match(server, client):
    model = server_model(server)
    rx = r"[A-Z][a-z]{1,6}-[0-9]{2,4}"
    r = client.completions.create(
        model=model, prompt="code:", max_tokens=20, n=4, temperature=1.0, seed=0, extra_body={"guided_regex": rx}
    )
    assert all(re.fullmatch(rx, c.text) for c in r.choices), [c.text for c in r.choices]
    choices = ["yes", "no", "maybe not"]
    r = client.chat.completions.create(
        model=model,
        messages=MSG,
        max_tokens=10,
        n=4,
        temperature=1.0,
        seed=1,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert all(c.message.content in choices for c in r.choices)
    r = client.chat.completions.create(
        model=model, messages=MSG, max_tokens=200, n=4, temperature=1.0, seed=2, extra_body={"guided_grammar": ARITH}
    )
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        assert re.fullmatch(r"[0-9+\-*/()]+", c.message.content)
        compile(c.message.content, "<arith>", "eval")  # parses as an arithmetic expression


@pytest.mark.timeout(600)  # the first to run starts the shared server
def test_reasoning_parser(server, client):
    """qwen3: <think>...</think> goes to reasoning_content, whole and streamed (forced by a regex)."""
    model = server_model(server)
    rx = r"<think>[a-z]{3,8}</think>[A-Z][a-z]{2,6}"
    kw = dict(model=model, messages=MSG, max_tokens=60, seed=4, extra_body={"guided_regex": rx})
    m = client.chat.completions.create(**kw).choices[0].message
    text = f"<think>{m.reasoning_content}</think>{m.content}"
    assert re.fullmatch(rx, text), text
    reasoning, content = "", ""
    for ch in client.chat.completions.create(stream=True, **kw):
        d = ch.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
    assert (reasoning, content) == (m.reasoning_content, m.content)
    # Without <think>, the answer is all content (thinking is optional for qwen3).
    m = (
        client.chat.completions.create(
            model=model, messages=MSG, max_tokens=5, seed=4, extra_body={"guided_regex": "[a-z]{3}"}
        )
        .choices[0]
        .message
    )
    assert m.reasoning_content is None and re.fullmatch("[a-z]{3}", m.content)


@pytest.mark.timeout(600)  # the first to run starts the shared server
@pytest.mark.parametrize(
    "body, param, words",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format",
            "json",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
        ({"guided_json": "{not json"}, "guided_json", "json"),
        ({"guided_regex": "(a"}, "guided_regex", "regex"),
        ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", "undefined_rule"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "only one"),
        ({"guided_regex": "a", "use_beam_search": True, "n": 2}, "guided_regex", "beam"),
    ],
)
def test_invalid_specs_400(server, body, param, words):
    for path, extra in (("/v1/chat/completions", {"messages": MSG}), ("/v1/completions", {"prompt": "hi"})):
        r = httpx.post(server.base_url[:-3] + path, json={**extra, "max_tokens": 5, **body}, timeout=30)
        err = assert_error(r, 400)
        assert err["param"] == param and words in err["message"], err


@pytest.mark.timeout(600)  # the first to run starts the shared server
def test_response_format_json_object(server):
    """OpenAI's `response_format: {"type": "json_object"}`: a JSON object every time (a random
    model: the grammar alone makes it one), streamed as whole; all at once (one batch)."""
    name = server_model(server)
    kw = dict(model=name, messages=MSG, response_format={"type": "json_object"}, temperature=1.0, max_tokens=300)

    async def run():
        client = server.async_client(timeout=300)

        async def streamed(seed):
            out = await client.chat.completions.create(seed=seed, stream=True, **kw)
            return "".join([ch.choices[0].delta.content or "" async for ch in out if ch.choices])

        try:
            return await asyncio.gather(
                asyncio.gather(*(client.chat.completions.create(seed=s, **kw) for s in SEEDS)),
                asyncio.gather(*(streamed(s) for s in SEEDS)),
            )
        finally:
            await client.close()

    wholes, streams = asyncio.run(run())
    finished = 0
    for r, text in zip(wholes, streams):
        c = r.choices[0]
        assert text == c.message.content
        if c.finish_reason == "stop":
            finished += 1
            assert isinstance(json.loads(c.message.content), dict), c.message.content
        else:  # cut by max_tokens: an object's beginning
            assert c.finish_reason == "length" and c.message.content.startswith("{"), c
    assert finished >= 3, finished
