"""The JSON grammars admit no whitespace between JSON tokens (only json.dumps' one space after
`,` and `:`): a small model under a grammar that admits whitespace runs can spend its whole
max_tokens on them and be cut before it wrote anything useful. Checked on the grammars the
server compiles (the tool-call grammars of tool_choice required / a named function, a
json_schema and response_format json_object) with xgrammar's matcher over the tiny tokenizer."""

import json

import pytest
from tiny_chat_model import VOCAB_SIZE, make_tiny_chat_model

from pagedllm.entrypoints.openai.tool_parsers.forced import required_schema
from pagedllm.sampling_params import StructuredOutputsParams as SO

TOOL = {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
FREE = {"name": "free"}  # no parameters schema: any object
SPECS = {
    "required": (
        SO(json=required_schema([TOOL, FREE], parallel=True)),
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "free", "parameters": {"a": [1, {}]}}]',
    ),
    "named": (SO(json=TOOL["parameters"]), '{"city": "Paris"}'),
    "json_object": (SO(json_object=True), '{"a": [1, {"b": null}], "c": "x y"}'),
}


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    from transformers import AutoTokenizer

    from pagedllm.structured_output.backend_xgrammar import XgrammarBackend

    tok = AutoTokenizer.from_pretrained(make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat")))
    return XgrammarBackend(tok, VOCAB_SIZE, [tok.eos_token_id])


def _accepts(backend, params: SO, text: str) -> bool:
    matcher = backend.compile(params.kind, params.spec).new_grammar().matcher
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("name", sorted(SPECS))
def test_compact_json_only(backend, name):
    params, text = SPECS[name]
    assert _accepts(backend, params, text)
    assert json.loads(text) is not None
    # Any more whitespace outside a string (before and after every structural character and
    # separator space) is refused: the model cannot write a run of it.
    in_string, boundaries = False, []
    for i, ch in enumerate(text):
        if ch == '"':
            in_string = not in_string
        elif not in_string and ch in "[]{},: ":
            boundaries += [i, i + 1]
    assert len(boundaries) >= 8
    for i in sorted(set(boundaries)):
        for ws in (" ", "\n", "\t"):
            spaced = text[:i] + ws + text[i:]
            assert not _accepts(backend, params, spaced), (name, spaced)


def test_json_object_is_an_object(backend):
    params, _ = SPECS["json_object"]
    assert not _accepts(backend, params, "[1, 2]") and not _accepts(backend, params, '"text"')
