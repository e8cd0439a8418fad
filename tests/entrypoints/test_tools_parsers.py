"""The tool and reasoning parsers on their own: whole outputs, and streamed deltas (every split of
the text into pieces) that add up to the whole."""
import json
import random

import pytest

from pagedllm.entrypoints.openai.reasoning import REASONING_PARSERS
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedllm.entrypoints.openai.tool_parsers.forced import NamedToolParser, RequiredToolParser
from pagedllm.entrypoints.openai.tool_parsers.streaming import ChatOutputParser

HERMES = ('Sure, one moment. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par, is", "n": 12.5, '
          '"deep": {"a": [1, 2, {"b": null}], "t": true}}}\n</tool_call>\n<tool_call>\n{"name": "noop", '
          '"arguments": {}}\n</tool_call>')
CASES = [
    (lambda: TOOL_PARSERS["hermes"](), None, HERMES, "Sure, one moment.",
     [("get_weather", {"city": "Par, is", "n": 12.5, "deep": {"a": [1, 2, {"b": None}], "t": True}}), ("noop", {})]),
    (lambda: TOOL_PARSERS["hermes"](), None, "no calls <tool at all", "no calls <tool at all", []),
    (lambda: TOOL_PARSERS["llama3_json"](), None,
     '<|python_tag|>{"name": "f", "parameters": {"x": "y"}}; {"name": "g", "parameters": {"z": [1]}}', None,
     [("f", {"x": "y"}), ("g", {"z": [1]})]),
    (lambda: TOOL_PARSERS["llama3_json"](), None, "plain answer", "plain answer", []),
    (lambda: RequiredToolParser(), None, '[{"name": "f", "parameters": {"a": "b}]"}}, {"name": "g", "parameters": {}}]',
     None, [("f", {"a": "b}]"}), ("g", {})]),
    (lambda: NamedToolParser("f"), None, '{"a": [1, 22], "b": "x\\"y"}', None, [("f", {"a": [1, 22], "b": 'x"y'})]),
    (lambda: None, "qwen3", "<think>hmm, let me see</think>\n\nThe answer.", "The answer.", []),
    (lambda: TOOL_PARSERS["hermes"](), "deepseek_r1", 'thinking</think>ok<tool_call>{"name": "f", "arguments": {}}'
     '</tool_call>', "ok", [("f", {})]),
]


@pytest.mark.parametrize("make_tool, reasoning, text, content, calls", CASES)
def test_whole_and_streamed(make_tool, reasoning, text, content, calls):
    def parser():
        return ChatOutputParser(REASONING_PARSERS[reasoning]() if reasoning else None, make_tool())
    r, c, tool_calls = parser().final(text)
    assert c == content
    assert [(t.function.name, json.loads(t.function.arguments)) for t in tool_calls] == calls
    rng = random.Random(0)
    for _ in range(30):   # random splits into stream pieces
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
