"""The tool and reasoning parsers on their own: whole outputs (hand-written expected reasoning,
content and calls), streamed deltas (random splits of the text into pieces) that add up to the
whole, and outputs cut by max_tokens."""

import json
import random

import pytest

from pagedllm.entrypoints.openai.reasoning import REASONING_PARSERS
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedllm.entrypoints.openai.tool_parsers.forced import NamedToolParser, RequiredToolParser
from pagedllm.entrypoints.openai.tool_parsers.streaming import ChatOutputParser

HERMES = (
    'Sure, one moment. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par, is", "n": 12.5, '
    '"deep": {"a": [1, 2, {"b": null}], "t": true}}}\n</tool_call>\n<tool_call>\n{"name": "noop", '
    '"arguments": {}}\n</tool_call>'
)
CASES = [
    (
        lambda: TOOL_PARSERS["hermes"](),
        None,
        HERMES,
        None,
        "Sure, one moment.",
        [("get_weather", {"city": "Par, is", "n": 12.5, "deep": {"a": [1, 2, {"b": None}], "t": True}}), ("noop", {})],
    ),
    (lambda: TOOL_PARSERS["hermes"](), None, "no calls <tool at all", None, "no calls <tool at all", []),
    (
        lambda: TOOL_PARSERS["llama3_json"](),
        None,
        '<|python_tag|>{"name": "f", "parameters": {"x": "y"}}; {"name": "g", "parameters": {"z": [1]}}',
        None,
        None,
        [("f", {"x": "y"}), ("g", {"z": [1]})],
    ),
    (lambda: TOOL_PARSERS["llama3_json"](), None, "plain answer", None, "plain answer", []),
    (
        lambda: RequiredToolParser(),
        None,
        '[{"name": "f", "parameters": {"a": "b}]"}}, {"name": "g", "parameters": {}}]',
        None,
        None,
        [("f", {"a": "b}]"}), ("g", {})],
    ),
    (
        lambda: NamedToolParser("f"),
        None,
        '{"a": [1, 22], "b": "x\\"y"}',
        None,
        None,
        [("f", {"a": [1, 22], "b": 'x"y'})],
    ),
    (lambda: None, "qwen3", "<think>hmm, let me see</think>\n\nThe answer.", "hmm, let me see", "The answer.", []),
    (
        lambda: TOOL_PARSERS["hermes"](),
        "deepseek_r1",
        'thinking</think>ok<tool_call>{"name": "f", "arguments": {}}</tool_call>',
        "thinking",
        "ok",
        [("f", {})],
    ),
    (lambda: None, "deepseek_r1", "still thinking <", "still thinking <", "", []),  # no </think>: all reasoning
    (lambda: None, "qwen3", "An answer, no thinking.", None, "An answer, no thinking.", []),
]


@pytest.mark.parametrize("make_tool, reasoning, text, reasoning_content, content, calls", CASES)
def test_whole_and_streamed(make_tool, reasoning, text, reasoning_content, content, calls):
    def parser():
        return ChatOutputParser(REASONING_PARSERS[reasoning]() if reasoning else None, make_tool())

    r, c, tool_calls = parser().final(text)
    assert r == reasoning_content and c == content
    assert [(t.function.name, json.loads(t.function.arguments)) for t in tool_calls] == calls
    rng = random.Random(0)
    for _ in range(30):  # random splits into stream pieces
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        p, got_r, got_c, got = parser(), "", "", {}
        for k, piece in enumerate(pieces):
            d = p.delta(piece, finished=k == len(pieces) - 1)
            got_r += d.get("reasoning_content", "")
            got_c += d.get("content", "")
            for tc in d.get("tool_calls", []):
                entry = got.setdefault(tc["index"], ["", ""])
                entry[0] += tc.get("function", {}).get("name") or ""
                entry[1] += tc["function"].get("arguments", "")
        assert got_r == (r or "") and got_c == (c or "")
        assert [tuple(v) for v in got.values()] == [(t.function.name, t.function.arguments) for t in tool_calls]


# Outputs cut by max_tokens -> (content, [(name, arguments text)]), by hand: the calls named so far,
# the last one's arguments as far as they are certain; cut before any name, the text itself.
CUT = [
    (RequiredToolParser, '[{"name": "get_w', '[{"name": "get_w', []),
    (RequiredToolParser, '[{"name": "f", "parameters": {"city": "Par', None, [("f", "{")]),
    (RequiredToolParser, '[{"name": "f", "parameters": {"city": "Paris", "n": 1', None, [("f", '{"city": "Paris"')]),
    (
        RequiredToolParser,
        '[{"name": "f", "parameters": {"a": [1, 2]}}, {"name": "g", "parameters": {"b',
        None,
        [("f", '{"a": [1, 2]}'), ("g", "{")],
    ),
    (RequiredToolParser, '[{"name": "f", "parameters": {"a": 1}}, {"na', None, [("f", '{"a": 1}')]),
    (RequiredToolParser, '[{"name": "f", "parameters": {"a": 1}}', None, [("f", '{"a": 1}')]),
    # (closing brackets at the end of an unfinished call are held back, as while streaming)
    (lambda: NamedToolParser("f"), '{"a": [1, 2], "b": "x', None, [("f", '{"a": [1, 2')]),
    (lambda: NamedToolParser("f"), '{"a": 1}', None, [("f", '{"a": 1}')]),
    (
        lambda: TOOL_PARSERS["hermes"](),
        'Hi. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
        '<tool_call>{"name": "g", "arguments": {"x": "y',
        "Hi.",
        [("f", '{"a": 1}'), ("g", "{")],
    ),
    (lambda: TOOL_PARSERS["hermes"](), "Hi. <tool_call>{\"na", "Hi. <tool_call>{\"na", []),
    (
        lambda: TOOL_PARSERS["llama3_json"](),
        '{"name": "f", "parameters": {"x": "y"}}; {"name": "g", "param',
        None,
        [("f", '{"x": "y"}'), ("g", "")],
    ),
]


@pytest.mark.parametrize("make_tool, text, content, calls", CUT)
def test_cut_by_max_tokens(make_tool, text, content, calls):
    _, c, tool_calls = ChatOutputParser(None, make_tool()).final(text, truncated=True)
    assert c == content
    assert [(t.function.name, t.function.arguments) for t in tool_calls] == calls
    # Streamed, with the last delta the cut: the same message.
    for size in (1, 3, 7):
        p, got_c, got = ChatOutputParser(None, make_tool()), "", {}
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            d = p.delta(piece, finished=last, truncated=last)
            got_c += d.get("content", "")
            for tc in d.get("tool_calls", []):
                entry = got.setdefault(tc["index"], ["", ""])
                entry[0] += tc.get("function", {}).get("name") or ""
                entry[1] += tc["function"].get("arguments", "")
        assert got_c == (c or "") and [tuple(v) for v in got.values()] == calls
