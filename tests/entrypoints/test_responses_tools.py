"""Function tools on /v1/responses with the official openai client against a real server
(conftest.py's `structured_server`: a random-weight model, Hermes tool calls, the qwen3 reasoning
parser, the Responses store on). A random model writes whatever its grammar allows, so: required
and named calls are checked against the function's JSON schema (jsonschema), an "auto" answer is
forced by a regex into thinking + text + a Hermes call and parsed back into the regex's pieces;
streamed events rebuild the whole answer; a call's function_call_output continues the
conversation (by previous_response_id and by sending the items back) with the prompt and greedy
answer of the chat endpoint on the same conversation written by hand; every body and event
parses as the `openai` package's own types in strict mode; bad tools are 400s naming the field."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from pydantic import TypeAdapter
from server_utils import assert_error

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
    {"type": "function", "name": "get_weather", "description": "weather in a city", "parameters": WEATHER},
    {"type": "function", "name": "get_time", "parameters": TIME},
]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = "What is the weather in Paris?"
# "auto": the output forced into thinking, text, then one Hermes call.
THINK, TEXT = r"<think>([a-z]{3,8})</think>", r"Let me check\."
CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,6}", "unit": "c"\}\}\n</tool_call>'
AUTO = dict(
    tools=TOOLS, max_output_tokens=150, extra_body={"seed": 3, "structured_outputs": {"regex": THINK + TEXT + CALL}}
)
ANSWER = "It is [0-9]{2} C"  # the answer after the call's output (real tokens only: see test_tools.py)


@pytest.fixture(scope="module")
def server(structured_server):
    return structured_server


def _calls(output) -> list[tuple[str, str]]:
    return [(it.name, it.arguments) for it in output if it.type == "function_call"]


def _check_calls(output, names=None) -> None:
    calls = [it for it in output if it.type == "function_call"]
    assert calls
    for c in calls:
        assert c.call_id and c.id and (names is None or c.name in names)
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])


def _summary(output) -> list[tuple]:
    """The items without their ids: (type, text or name and arguments, status)."""

    def what(it):
        if it.type == "function_call":
            return it.name, it.arguments
        return tuple(p.text for p in it.content)

    return [(it.type, what(it), it.status) for it in output]


@pytest.mark.timeout(600)  # the first to run starts the shared server
def test_required_and_named_calls_follow_the_schema(client, model):
    for seed in range(2):
        r = client.responses.create(
            model=model,
            input=ASK,
            tools=TOOLS,
            tool_choice="required",
            max_output_tokens=200,
            temperature=1.0,
            extra_body={"seed": seed},
        )
        assert r.status == "completed" and {it.type for it in r.output} == {"function_call"}
        _check_calls(r.output)
        r = client.responses.create(
            model=model,
            input=ASK,
            tools=TOOLS,
            max_output_tokens=200,
            tool_choice={"type": "function", "name": "get_time"},
            extra_body={"seed": seed},
        )
        assert len(r.output) == 1
        _check_calls(r.output, {"get_time"})
        assert r.tool_choice.name == "get_time" and [t.name for t in r.tools] == ["get_weather", "get_time"]
    r = client.responses.create(
        model=model,
        input=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
        extra_body={"seed": 9},
    )
    assert len(r.output) == 1 and not r.parallel_tool_calls


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_streamed_calls_equal_whole(client, model, tool_choice):
    kw = dict(
        model=model,
        input=ASK,
        tools=TOOLS,
        tool_choice=tool_choice,
        max_output_tokens=200,
        temperature=1.0,
        extra_body={"seed": 5},
    )
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert _summary(final.output) == _summary(whole.output) and final.status == "completed"
    _check_calls(final.output)
    # Per call: added, its argument deltas, done (the deltas add up to the arguments), item done.
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    for i, item in enumerate(final.output):
        mine = [e for e in events if getattr(e, "output_index", None) == i]
        kinds = [e.type for e in mine]
        assert kinds[0] == "response.output_item.added" and kinds[-2:] == [
            "response.function_call_arguments.done",
            "response.output_item.done",
        ], kinds
        assert set(kinds[1:-2]) == {"response.function_call_arguments.delta"}
        assert "".join(e.delta for e in mine[1:-2]) == mine[-2].arguments == item.arguments
        assert mine[0].item.call_id == item.call_id and mine[-1].item.status == "completed"


@pytest.fixture(scope="module")
def auto_answer(client, model):
    """The forced "auto" answer: thinking, text, one call; each piece as the regex made it."""
    r = client.responses.create(model=model, input=ASK, **AUTO)
    assert [it.type for it in r.output] == ["reasoning", "message", "function_call"], r.output
    thinking, message, call = r.output
    assert r.status == "completed" and r.output_text == "Let me check." == message.content[0].text
    raw = (
        f"<think>{thinking.content[0].text}</think>{r.output_text}<tool_call>\n"
        + json.dumps({"name": call.name, "arguments": json.loads(call.arguments)})
        + "\n</tool_call>"
    )
    assert re.fullmatch(THINK + TEXT + CALL, raw), raw
    _check_calls(r.output, {"get_weather"})
    return r


@pytest.mark.timeout(600)
def test_auto_reasoning_text_and_call_streamed(client, model, auto_answer):
    with client.responses.stream(model=model, input=ASK, **AUTO) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert _summary(final.output) == _summary(auto_answer.output)
    text_item = [
        "response.output_item.added",
        "response.content_part.added",
        "{}.delta",
        "{}.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    expected = (
        ["response.created", "response.in_progress"]
        + [t.format("response.reasoning_text") for t in text_item]
        + [t.format("response.output_text") for t in text_item]
        + [
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
    )
    got = [e.type for e in events]
    squeezed = [t for j, t in enumerate(got) if j == 0 or t != got[j - 1] or not t.endswith(".delta")]
    assert squeezed == expected, got
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for kind, item in (("reasoning_text", final.output[0]), ("output_text", final.output[1])):
        deltas = [e.delta for e in events if e.type == f"response.{kind}.delta"]
        assert "".join(deltas) == item.content[0].text


def _strict(type_, body):
    """`body` as the openai package's type, strict: a wrong type or a missing field fails."""
    return TypeAdapter(type_).validate_python(body, strict=True)


@pytest.mark.timeout(600)
def test_bodies_and_events_are_openai_types(server, model, auto_answer):
    from openai.types.responses import Response, ResponseStreamEvent

    body = {"model": model, "input": ASK, **{k: v for k, v in AUTO.items() if k != "extra_body"}, **AUTO["extra_body"]}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert [it.type for it in _strict(Response, r.json()).output] == ["reasoning", "message", "function_call"]
    r = httpx.post(server.url + "/v1/responses", json={**body, "stream": True}, timeout=120)
    data = [json.loads(ln[len("data: ") :]) for ln in r.text.splitlines() if ln.startswith("data: ")]
    names = [ln[len("event: ") :] for ln in r.text.splitlines() if ln.startswith("event: ")]
    assert names == [d["type"] for d in data] and "[DONE]" not in r.text
    for d in data:
        _strict(ResponseStreamEvent, d)
    assert data[-1]["type"] == "response.completed"


@pytest.mark.timeout(600)
def test_function_call_output_continues_the_conversation(client, model, auto_answer):
    """The call's output goes back by previous_response_id, or with the answer's items as input
    (OpenAI's two ways): both are the chat endpoint's conversation (prompt length, greedy answer)."""
    call = auto_answer.output[2]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temp": 21})}
    kw = dict(
        model=model,
        tools=TOOLS,
        temperature=0,
        max_output_tokens=20,
        extra_body={"structured_outputs": {"regex": ANSWER}},
    )
    assert auto_answer.store and client.responses.retrieve(auto_answer.id).output_text == "Let me check."
    by_id = client.responses.create(previous_response_id=auto_answer.id, input=[result], **kw)
    items = [{"role": "user", "content": ASK}] + [it.model_dump(exclude_none=True) for it in auto_answer.output]
    by_items = client.responses.create(input=items + [result], store=False, **kw)
    with client.responses.stream(previous_response_id=auto_answer.id, input=[result], **kw) as stream:
        streamed = stream.get_final_response()
    chat = client.chat.completions.create(
        model=model,
        tools=CHAT_TOOLS,
        temperature=0,
        max_tokens=20,
        extra_body=kw["extra_body"],
        messages=[
            {"role": "user", "content": ASK},
            {
                "role": "assistant",
                "content": "Let me check.",
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": result["output"]},
        ],
    )
    text = chat.choices[0].message.content
    assert re.fullmatch(ANSWER, text) and not chat.choices[0].message.tool_calls
    for r in (by_id, by_items, streamed):
        assert [it.type for it in r.output] == ["message"] and r.output_text == text
        assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert by_id.previous_response_id == auto_answer.id and not by_items.store


@pytest.mark.timeout(600)
def test_text_format_json_schema(client, model):
    r = client.responses.create(
        model=model,
        input=ASK,
        max_output_tokens=100,
        extra_body={"seed": 1},
        text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER}},
    )
    jsonschema.validate(json.loads(r.output_text), WEATHER)
    assert r.text.format.type == "json_schema" and r.text.format.name == "weather"


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [{"type": "function", "name": "f", "parameters": {"type": "nope"}}], "tool_choice": "required"},
            "tools",
        ),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),  # chat's nested shape
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"regex": "a"}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input"),
        ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ],
)
def test_bad_tools_400(server, body, param):
    r = httpx.post(server.url + "/v1/responses", json={"input": ASK, "max_output_tokens": 5, **body}, timeout=30)
    assert assert_error(r, 400)["param"] == param
