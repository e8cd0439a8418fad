"""The `llama3_json` tool parser and the `deepseek_r1` reasoning parser end to end: a real server
(`--enable-auto-tool-choice --tool-call-parser llama3_json --reasoning-parser deepseek_r1`) of
the tiny random chat model, its output forced by a regex into DeepSeek-R1's shape (thinking up
to `</think>`, no opening tag) followed by a Llama 3 JSON call; the official client gets the
reasoning, the call and finish_reason "tool_calls", and the stream's deltas add up to the same."""

import json
import re
import sys
from pathlib import Path

import pytest
from server_utils import RemoteServer

sys.path.insert(0, str(Path(__file__).parent.parent / "structured_output"))
from tiny_chat_model import make_tiny_chat_model  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
MSG = [{"role": "user", "content": "What is the weather in Oslo?"}]
THINKING = r"hmm[a-z ]{0,8}"
CITY = r"[A-Z][a-z]{2,6}"
FORCED = THINKING + r'</think>\{"name": "get_weather", "parameters": \{"city": "' + CITY + r'"\}\}'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
    srv = RemoteServer(
        [
            "--model",
            str(model),
            "--max-model-len",
            "512",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "llama3_json",
            "--reasoning-parser",
            "deepseek_r1",
        ]
    )
    yield srv
    srv.close()


@pytest.mark.timeout(300)  # the first to run starts the server
def test_llama3_json_call_after_deepseek_r1_thinking(client):
    model = client.models.list().data[0].id
    kw = dict(
        model=model,
        messages=MSG,
        tools=TOOLS,
        max_tokens=120,
        temperature=1.0,
        extra_body={"structured_outputs": {"regex": FORCED}},
    )
    for seed in range(3):
        c = client.chat.completions.create(seed=seed, **kw).choices[0]
        m = c.message
        assert c.finish_reason == "tool_calls", c
        reasoning = m.model_extra["reasoning_content"]
        assert re.fullmatch(THINKING, reasoning), reasoning
        assert not m.content
        (call,) = m.tool_calls
        assert call.function.name == "get_weather"
        args = json.loads(call.function.arguments)
        assert list(args) == ["city"] and re.fullmatch(CITY, args["city"]), args
        # Streamed: the same reasoning, call and finish reason.
        got_r, got_c, calls, finish = "", "", {}, None
        for ch in client.chat.completions.create(seed=seed, stream=True, **kw):
            d = ch.choices[0].delta
            finish = ch.choices[0].finish_reason or finish
            got_r += (d.model_extra or {}).get("reasoning_content") or ""
            got_c += d.content or ""
            for tc in d.tool_calls or []:
                e = calls.setdefault(tc.index, ["", ""])
                e[0] += (tc.function and tc.function.name) or ""
                e[1] += (tc.function and tc.function.arguments) or ""
        assert (got_r, got_c, finish) == (reasoning, "", "tool_calls")
        assert list(calls.values()) == [["get_weather", call.function.arguments]]
