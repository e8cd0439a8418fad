"""Tool calling with the official openai client against a real server (tests/conftest.py's
`structured_server`: Hermes parser, a template without `tools`, so the Hermes system block):
required and named functions give arguments valid for the function's schema every time (the
grammar enforces them, on a random-weight model), "auto" parses a Hermes call from text
(forced here by a regex), streaming deltas concatenate to the same calls, and a history with the
assistant's calls and the tool's answers is accepted."""

import asyncio
import json

import jsonschema
import pytest
from server_utils import assert_error

import httpx

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "weather in a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(structured_server):
    return structured_server


def _check_calls(calls, names=None):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id
        assert names is None or c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def _streamed_calls(stream):
    """{index: [id, name, arguments]} from the deltas, and the finish reason."""
    calls, finish = {}, None
    for ch in stream:
        choice = ch.choices[0]
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or []:
            entry = calls.setdefault(d.index, [None, None, ""])
            if d.id:
                assert entry[0] is None, "the id comes once"
                entry[0] = d.id
            if d.function and d.function.name:
                assert entry[1] is None, "the name comes once"
                entry[1] = d.function.name
            if d.function and d.function.arguments:
                entry[2] += d.function.arguments
    return calls, finish


@pytest.mark.timeout(600)  # the first to run starts the shared server
def test_required_and_named_always_valid(client, model):
    for seed in range(2):
        r = client.chat.completions.create(
            model=model,
            messages=MSG,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=200,
            temperature=1.0,
            seed=seed,
            n=2,
        )
        for c in r.choices:
            assert c.finish_reason == "tool_calls"
            _check_calls(c.message.tool_calls)
        r = client.chat.completions.create(
            model=model,
            messages=MSG,
            tools=TOOLS,
            max_tokens=200,
            seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
        )
        _check_calls(r.choices[0].message.tool_calls, {"get_time"})
        assert len(r.choices[0].message.tool_calls) == 1
    r = client.chat.completions.create(
        model=model,
        messages=MSG,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        seed=9,
    )
    assert len(r.choices[0].message.tool_calls) == 1


@pytest.mark.timeout(600)  # the first to run starts the shared server
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_calls_equal_whole(client, model, tool_choice):
    kw = dict(model=model, messages=MSG, tools=TOOLS, tool_choice=tool_choice, max_tokens=200, seed=5, temperature=1.0)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls, finish = _streamed_calls(client.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls"
    assert [(n, a) for _, n, a in calls.values()] == [(c.function.name, c.function.arguments) for c in whole]
    _check_calls(whole)


HERMES = r'Let me check\.<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,6}", "unit": "c"\}\}\n</tool_call>'


@pytest.mark.timeout(600)  # the first to run starts the shared server
def test_auto_parses_hermes_text_and_round_trip(client, model):
    kw = dict(
        model=model,
        messages=MSG,
        tools=TOOLS,
        max_tokens=120,
        seed=3,
        extra_body={"structured_outputs": {"regex": HERMES}},
    )
    r = client.chat.completions.create(**kw)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content == "Let me check."
    _check_calls(m.tool_calls, {"get_weather"})
    calls, finish = _streamed_calls(client.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls"
    assert [(n, a) for _, n, a in calls.values()] == [(c.function.name, c.function.arguments) for c in m.tool_calls]
    # The call and its result go back into the history; the model answers (in text this time).
    history = MSG + [
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in m.tool_calls]},
        {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": '{"temp": 21}'},
    ]
    r = client.chat.completions.create(
        model=model,
        messages=history,
        tools=TOOLS,
        max_tokens=30,
        seed=1,
        extra_body={"guided_regex": "It is [0-9]{2} C"},
    )
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content.startswith("It is ")
    # tool_choice none: no tools, plain text (constrained too: the model's logits are wider than
    # its tokenizer, and an id past the tokenizer is no text).
    r = client.chat.completions.create(
        model=model,
        messages=MSG,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=8,
        extra_body={"guided_regex": "[a-z]{3}"},
    )
    assert not r.choices[0].message.tool_calls and len(r.choices[0].message.content) == 3


@pytest.mark.timeout(600)  # the first to run starts the shared server
@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools"),
    ],
)
def test_bad_tools_400(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 5, **body}, timeout=30)
    assert assert_error(r, 400)["param"] == param


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[a-z]{3,6}$"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CITY_TOOL = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
NAMED = '"name": "get_weather"'


async def _message_of_stream(stream):
    """(content, [(name, arguments)], finish_reason) from the deltas."""
    content, calls, finish = "", {}, None
    async for ch in stream:
        choice = ch.choices[0]
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            entry = calls.setdefault(d.index, ["", ""])
            entry[0] += (d.function and d.function.name) or ""
            entry[1] += (d.function and d.function.arguments) or ""
    return content, [tuple(v) for v in calls.values()], finish


@pytest.mark.timeout(600)  # the first to run starts the shared server
def test_required_cut_by_max_tokens_keeps_what_was_generated(server, client, model):
    """A forced call cut by max_tokens at every token: what the model wrote is in the answer, as
    OpenAI's API does it (finish_reason "length"): the calls named so far, the last one with the
    arguments written so far (up to an unfinished value); cut before the name, the text as content.
    The stream's deltas add up to the same message."""
    kw = dict(
        model=model, messages=MSG, tools=CITY_TOOL, tool_choice="required", parallel_tool_calls=False, temperature=0
    )
    whole = client.chat.completions.create(max_tokens=200, logprobs=True, **kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    (call,) = whole.message.tool_calls
    # The grammar writes compact JSON with json.dumps' separators: the raw output, by hand.
    raw = '[{"name": "get_weather", "parameters": ' + call.function.arguments + "}]"
    tokens = [t.token for t in whole.logprobs.content]
    assert "".join(tokens[:-1]) == raw  # the last token is the end of the turn
    args_at = raw.index('"parameters": ') + len('"parameters": ')
    cuts = range(1, len(tokens) - 1)

    async def every_cut():  # all at once (one batch), whole and streamed
        aclient = server.async_client()
        try:

            async def streamed(k):
                return await _message_of_stream(await aclient.chat.completions.create(max_tokens=k, stream=True, **kw))

            return await asyncio.gather(
                asyncio.gather(*(aclient.chat.completions.create(max_tokens=k, **kw) for k in cuts)),
                asyncio.gather(*(streamed(k) for k in cuts)),
            )
        finally:
            await aclient.close()

    wholes, streams = asyncio.run(every_cut())
    for k, w, streamed in zip(cuts, wholes, streams):
        text = "".join(tokens[:k])
        r = w.choices[0]
        m = r.message
        assert r.finish_reason == "length", (k, r)
        if NAMED not in text:  # cut before the name is whole: the text itself
            assert m.content == text and not m.tool_calls, (k, text, m)
            got = (text, [])
        else:
            assert m.content is None and [c.function.name for c in m.tool_calls] == ["get_weather"], (k, text, m)
            args = m.tool_calls[0].function.arguments
            written = text[args_at:]
            # What was written, up to an unfinished string or number at the cut (and the brackets
            # that close the arguments when they are closed).
            assert written.startswith(args) and len(written) - len(args) <= len('"city": "abcdef"'), (k, text, args)
            if written.endswith("}}"):  # the call is closed: its arguments are whole
                assert json.loads(args) == json.loads(call.function.arguments), (k, text, args)
            got = ("", [("get_weather", args)])
        assert streamed == (*got, "length"), k
