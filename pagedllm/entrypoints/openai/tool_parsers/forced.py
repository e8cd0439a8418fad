"""Tool calls forced by the grammar: `tool_choice="required"` makes the model write a JSON array
of {"name", "parameters"} (at least one), a named function makes it write the arguments alone."""
from __future__ import annotations

from typing import Optional

from pagedllm.entrypoints.openai.tool_parsers.abstract import (ParsedCall, ParsedOutput, ToolParser, call_from,
                                                               loads)


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """The JSON schema of `required`: one or more calls of the given functions."""
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t["name"]]},
                             "parameters": t.get("parameters") or {"type": "object"}},
              "required": ["name", "parameters"]} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class RequiredToolParser(ToolParser):
    def extract(self, text: str, partial: bool) -> ParsedOutput:
        calls = loads(text, partial)
        out = ParsedOutput()
        for i, obj in enumerate(calls if isinstance(calls, list) else []):
            # Only the last element can still grow.
            call = call_from(obj, "parameters", not partial or i < len(calls) - 1)
            if call is not None:
                out.calls.append(call)
        return out


class NamedToolParser(ToolParser):
    def __init__(self, name: str) -> None:
        self.name = name

    def extract(self, text: str, partial: bool) -> ParsedOutput:
        args: Optional[object] = loads(text, partial)
        return ParsedOutput(calls=[ParsedCall(self.name, args if args is not None else {}, not partial)])
