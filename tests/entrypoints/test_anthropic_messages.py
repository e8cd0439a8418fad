"""Anthropic's Messages API (/v1/messages) with the official `anthropic` SDK against a real server:
greedy text equal whole and streamed (the SDK's stream helper parses the events) and equal to
the chat endpoint's for the same conversation, stop sequences, max_tokens, count_tokens equal to
transformers' chat template, errors in Anthropic's shape naming the field; and (on the shared
Hermes tool server) a forced tool_use block, streamed as input_json_delta, then a tool_result
turn accepted."""

import json

import anthropic
import httpx
import jsonschema
import pytest

SYSTEM = "You are a helpful assistant. Answer briefly."
MSGS = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": [{"type": "text", "text": "And of Italy?"}]},
]
# The SDK has no sampling arguments (the API takes temperature, top_p and top_k in the body).
GREEDY = {"temperature": 0}
CHAT = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)


@pytest.mark.timeout(600)  # the first to run may start the shared server
def test_text_whole_streamed_and_as_chat(claude, client, model):
    kw = dict(model=model, system=[{"type": "text", "text": SYSTEM}], messages=MSGS, max_tokens=24, extra_body=GREEDY)
    msg = claude.messages.create(**kw)
    assert msg.type == "message" and msg.role == "assistant" and msg.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=24, temperature=0)
    assert msg.content[0].text == chat.choices[0].message.content
    assert msg.usage.input_tokens == chat.usage.prompt_tokens
    assert msg.usage.output_tokens == chat.usage.completion_tokens
    assert msg.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]

    with claude.messages.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].text == msg.content[0].text and final.stop_reason == msg.stop_reason
    assert final.usage.input_tokens == msg.usage.input_tokens and final.usage.output_tokens == msg.usage.output_tokens
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds and "message_delta" in kinds


def test_system_string_max_tokens_and_stop_sequence(claude, model):
    ask = [{"role": "user", "content": "Describe the city of Paris in two sentences."}]
    kw = dict(model=model, system=SYSTEM, messages=ask, extra_body=GREEDY)
    full = claude.messages.create(max_tokens=24, **kw).content[0].text
    short = claude.messages.create(max_tokens=2, **kw)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2
    assert full.startswith(short.content[0].text)
    word = full.split()[2]  # a sequence met after the first words
    r = claude.messages.create(max_tokens=24, stop_sequences=["zzqx", word], **kw)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == word
    assert r.content[0].text == full[: full.index(word)]
    with claude.messages.stream(max_tokens=24, stop_sequences=[word], **kw) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == word
    assert final.content[0].text == r.content[0].text
    # temperature / top_p / top_k are taken (a top_k of 1 is greedy)
    sampled = {**kw, "extra_body": {"temperature": 1.0, "top_k": 1, "top_p": 0.9}}
    assert claude.messages.create(max_tokens=24, **sampled).content[0].text == full


def test_count_tokens_is_the_chat_templates(claude, model, tokenizer):
    n = claude.messages.count_tokens(model=model, system=SYSTEM, messages=MSGS).input_tokens
    assert n == len(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False))


def _error(r, status, field=None):
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    if field is not None:
        assert field in body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize(
    "body, field",
    [
        ({"messages": MSGS}, "max_tokens"),  # required, as Anthropic
        ({"messages": MSGS, "max_tokens": 0}, "max_tokens"),
        ({"messages": MSGS, "max_tokens": "5"}, "max_tokens"),
        ({"messages": [], "max_tokens": 5}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}], "max_tokens": 5}, "role"),
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}], "max_tokens": 5}, "image"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}
                ],
                "max_tokens": 5,
            },
            "messages[0].content[0]: images need a vision-language model",
        ),
        ({"messages": MSGS, "max_tokens": 5, "temperature": -1}, "temperature"),
        ({"messages": MSGS, "max_tokens": 5, "tool_choice": {"type": "any"}}, "tool_choice"),
        ({"messages": MSGS, "max_tokens": 5, "stop_sequences": [""]}, "stop_sequences"),
    ],
)
def test_bad_input_is_an_anthropic_400(server, model, body, field):
    r = httpx.post(server.url + "/v1/messages", json={"model": model, **body}, timeout=30)
    assert _error(r, 400, field)["type"] == "invalid_request_error"


def test_sdk_raises_its_errors(claude, model):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=model, messages=MSGS, max_tokens=-3)
    assert "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="no-such-model", messages=MSGS, max_tokens=3)


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"name": "get_weather", "description": "weather in a city", "input_schema": WEATHER}]


@pytest.mark.timeout(600)  # starts the shared tool server
def test_tool_use_round_trip(structured_server):
    claude = anthropic.Anthropic(base_url=structured_server.url, api_key="none", max_retries=0, timeout=120)
    model = structured_server.client().models.list().data[0].id
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(
        model=model,
        messages=ask,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        max_tokens=80,
        extra_body=GREEDY,
    )
    msg = claude.messages.create(**kw)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id
    jsonschema.validate(uses[0].input, WEATHER)
    with claude.messages.stream(**kw) as s:
        events = list(s)
        final = s.get_final_message()
    assert any(e.type == "input_json" for e in events)  # the SDK's view of input_json_delta
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(uses[0].name, uses[0].input)]
    # the call and its result go back; the model answers in text (tool_choice none)
    history = ask + [
        {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": json.dumps({"temp": 21})}],
        },
    ]
    r = claude.messages.create(
        model=model, messages=history, tools=TOOLS, tool_choice={"type": "none"}, max_tokens=4, extra_body=GREEDY
    )
    assert r.stop_reason in ("end_turn", "max_tokens") and not [b for b in r.content if b.type == "tool_use"]
    n = claude.messages.count_tokens(model=model, messages=history, tools=TOOLS).input_tokens
    assert n > claude.messages.count_tokens(model=model, messages=history).input_tokens
