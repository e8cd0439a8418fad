"""Tool calls forced by the grammar: `tool_choice="required"` makes the model write a JSON array
of {"name", "parameters"} (at least one), a named function makes it write the arguments alone."""

from __future__ import annotations

from typing import Optional

from pagedllm.entrypoints.openai.tool_parsers.abstract import ParsedCall, ParsedOutput, ToolParser, call_from, loads


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """The JSON schema of `required`: one or more calls of the given functions."""
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["name"]]},
                "parameters": t.get("parameters") or {"type": "object"},
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _closed(text: str) -> bool:
    """Whether the JSON text is whole, or an array whose last element is."""
    return loads(text, partial=False) is not None or loads(text + "]", partial=False) is not None


class RequiredToolParser(ToolParser):
    def extract(self, text: str, partial: bool) -> ParsedOutput:
        calls = loads(text, partial)
        out = ParsedOutput()
        last_closed = not partial or _closed(text)
        for i, obj in enumerate(calls if isinstance(calls, list) else []):
            # Only the last element can still grow, until its brace is written.
            call = call_from(obj, "parameters", last_closed or i < len(calls) - 1)
            if call is not None:
                out.calls.append(call)
        return out


class NamedToolParser(ToolParser):
    def __init__(self, name: str) -> None:
        self.name = name

    def extract(self, text: str, partial: bool) -> ParsedOutput:
        args: Optional[object] = loads(text, partial)
        if args is None and not partial and text.strip():  # not JSON (an output cut short): text
            return ParsedOutput(content=text)
        return ParsedOutput(
            calls=[ParsedCall(self.name, args if args is not None else {}, not partial or _closed(text))]
        )
