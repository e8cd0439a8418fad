"""The mistral, pythonic and qwen3_xml tool parsers against fixed outputs written as each family's
chat template writes calls, with the expected content and calls by hand: whole, and streamed
through the real streaming code (ChatOutputParser.delta) one character at a time, one token at a
time (the default model's tokenizer, decoded incrementally as the detokenizer does) and in
random pieces; the streamed fragments must add up to the whole message."""

import json
import random

import pytest

from pagedllm.engine.llm_engine import load_tokenizer
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedllm.entrypoints.openai.tool_parsers.streaming import ChatOutputParser
from pagedllm.models.download import resolve_model

WEATHER_TOOLS = [
    {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "verbose": {"type": "boolean"},
                "ratio": {"type": "number"},
                "filters": {"type": "object"},
            },
        },
    },
    {"name": "noop", "parameters": {}},
]

QWEN3_CALLS = (
    "I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=verbose>\ntrue\n</parameter>\n<parameter=ratio>\n"
    "0.25\n</parameter>\n<parameter=filters>\n{\"min\": 1.5, \"tags\": [\"a\", \"b\"]}\n</parameter>\n"
    "</function>\n</tool_call>\n<tool_call>\n<function=noop>\n</function>\n</tool_call>"
)
WEATHER = {
    "city": "San Francisco",
    "days": 3,
    "verbose": True,
    "ratio": 0.25,
    "filters": {"min": 1.5, "tags": ["a", "b"]},
}

# (parser, tools, output text, content, [(name, arguments)])
CASES = [
    (
        "mistral",
        None,
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "get_time", "arguments": {"tz": "CET"}}]',
        None,
        [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": "CET"})],
    ),
    (
        "mistral",
        None,
        'Let me check.[TOOL_CALLS]get_weather{"city": "Paris", "days": [1, 2]}[TOOL_CALLS]noop{}',
        "Let me check.",
        [("get_weather", {"city": "Paris", "days": [1, 2]}), ("noop", {})],
    ),
    (
        "mistral",
        None,
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Par}is", "n": null}',
        None,
        [("get_weather", {"city": "Par}is", "n": None})],
    ),
    ("mistral", None, "No call, just [TOOL talk.", "No call, just [TOOL talk.", []),
    (
        "pythonic",
        None,
        "[get_weather(city='San Francisco, CA', days=3, opts={'a': [1, 2.5], 'b': None}), noop()]",
        None,
        [("get_weather", {"city": "San Francisco, CA", "days": 3, "opts": {"a": [1, 2.5], "b": None}}), ("noop", {})],
    ),
    (
        "pythonic",
        None,
        '<|python_start|>[search(q="a, (b)]", exact=True)]<|python_end|>',
        None,
        [("search", {"q": "a, (b)]", "exact": True})],
    ),
    ("pythonic", None, "[1, 2] is a list.", "[1, 2] is a list.", []),
    ("pythonic", None, "The answer is 4.", "The answer is 4.", []),
    ("qwen3_xml", WEATHER_TOOLS, QWEN3_CALLS, "I will check.", [("get_weather", WEATHER), ("noop", {})]),
    # No schema: every value stays text (as vLLM); a value keeps its inner newlines.
    (
        "qwen3_xml",
        None,
        "<tool_call>\n<function=write>\n<parameter=path>\na.py\n</parameter>\n<parameter=body>\n"
        "x = 1\nif x < 2:\n    y = 3\n</parameter>\n<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>",
        None,
        [("write", {"path": "a.py", "body": "x = 1\nif x < 2:\n    y = 3", "n": "3"})],
    ),
    ("qwen3_xml", None, "A plain answer <b>bold</b>.", "A plain answer <b>bold</b>.", []),
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(resolve_model("SmolLM2-135M-Instruct", None)))


def parser(name: str, tools) -> ChatOutputParser:
    return ChatOutputParser(None, TOOL_PARSERS[name](tools))


def streamed(name: str, tools, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    p, content, calls = parser(name, tools), "", {}
    for k, piece in enumerate(pieces):
        d = p.delta(piece, finished=k == len(pieces) - 1)
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            entry = calls.setdefault(tc["index"], ["", ""])
            entry[0] += tc.get("function", {}).get("name") or ""
            entry[1] += tc["function"].get("arguments", "")
    return content, [tuple(v) for v in calls.values()]


def token_pieces(tokenizer, text: str) -> list[str]:
    """The text as the detokenizer streams it: each token's new characters."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    texts = [tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]
    return [b[len(a) :] for a, b in zip(texts, texts[1:]) if b != a]


@pytest.mark.parametrize("name, tools, text, content, calls", CASES)
def test_whole_and_streamed(tokenizer, name, tools, text, content, calls):
    _, c, tool_calls = parser(name, tools).final(text)
    assert c == content
    assert [(t.function.name, json.loads(t.function.arguments)) for t in tool_calls] == calls
    whole = (c or "", [(t.function.name, t.function.arguments) for t in tool_calls])
    rng = random.Random(0)
    splits = [list(text), token_pieces(tokenizer, text)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        splits.append([text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])])
    for pieces in splits:
        assert streamed(name, tools, pieces) == whole, pieces


def test_mistral_keeps_special_tokens_and_the_others_do_not():
    assert TOOL_PARSERS["mistral"].keeps_special_tokens
    assert not any(TOOL_PARSERS[n].keeps_special_tokens for n in ("pythonic", "qwen3_xml", "hermes", "llama3_json"))


# Cut by max_tokens -> (content, [(name, arguments text)]), by hand: the calls named so far, the
# last one's arguments as far as they are certain (docs: streaming.py).
CUT = [
    ("pythonic", None, "[f(a=1, b='x", None, [("f", '{"a": 1')]),
    ("pythonic", None, "[f(a=[1, 2]), g(", None, [("f", '{"a": [1, 2]}'), ("g", "{")]),
    ("mistral", None, 'Hi.[TOOL_CALLS]f{"a": 1}[TOOL_CALLS]g{"b": "x', "Hi.", [("f", '{"a": 1}'), ("g", "{")]),
    (
        "qwen3_xml",
        WEATHER_TOOLS,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3",
        None,
        [("get_weather", '{"city": "Paris"')],
    ),
]


@pytest.mark.parametrize("name, tools, text, content, calls", CUT)
def test_cut_by_max_tokens(name, tools, text, content, calls):
    _, c, tool_calls = parser(name, tools).final(text, truncated=True)
    assert c == content
    assert [(t.function.name, t.function.arguments) for t in tool_calls] == calls
