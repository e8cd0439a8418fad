"""Qwen3-Coder's XML format: text, then calls as its chat template writes them,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A value is text; as vLLM's qwen3_coder parser does, it is typed by the request's schema for that
parameter (integer, number, boolean, object / array as JSON) and stays a string otherwise;
`null` is None. While streaming, a call is named once `<function=NAME>` is closed and a
parameter reported once its `</parameter>` has come."""

from __future__ import annotations

import json
import re
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract import ParsedCall, ParsedOutput, ToolParser, held_back

CALL, FUNCTION, FUNCTION_END = "<tool_call>", "<function=", "</function>"
_PARAM = re.compile(r"<parameter=([^>]*)>(.*?)</parameter>", re.S)


class Qwen3XmlToolParser(ToolParser):
    def extract(self, text: str, partial: bool) -> ParsedOutput:
        starts = [i for i in (text.find(CALL), text.find(FUNCTION)) if i >= 0]
        if not starts:  # a tail that may begin a call waits while streaming
            if not partial:
                return ParsedOutput(text)
            cut = max(held_back(text, CALL), held_back(text, FUNCTION))
            return ParsedOutput(text[: len(text) - cut].rstrip())
        head, rest = text[: min(starts)], text[min(starts) :]
        out = ParsedOutput(content=head.rstrip())
        for block in rest.split(FUNCTION)[1:]:
            name, gt, body = block.partition(">")
            if not gt:
                if not partial:
                    return ParsedOutput(text)  # not a call after all
                out.calls.append(ParsedCall(None))  # the name is still being written
                break
            body, closed, _ = body.partition(FUNCTION_END)
            if not closed and not partial:
                return ParsedOutput(text)  # an unfinished call: the text (cut by max_tokens: see streaming.py)
            name = name.strip()
            args = {key.strip(): self._value(name, key.strip(), value) for key, value in _PARAM.findall(body)}
            out.calls.append(ParsedCall(name, args, complete=bool(closed)))
        if not out.calls and not partial:
            return ParsedOutput(text)
        return out

    def _value(self, function: str, key: str, text: str) -> Any:
        """The parameter's text (its template's one newline each side taken off), typed by the schema."""
        if text.startswith("\n"):
            text = text[1:]
        if text.endswith("\n"):
            text = text[:-1]
        if text.strip().lower() == "null":
            return None
        kind = self._schema_type(function, key)
        try:
            if kind == "integer":
                return int(text.strip())
            if kind == "number":
                number = float(text.strip())
                return int(number) if number.is_integer() else number  # as vLLM
            if kind == "boolean":
                return {"true": True, "false": False}[text.strip().lower()]
            if kind in ("object", "array"):
                return json.loads(text)
        except (ValueError, KeyError):
            pass  # as vLLM: a value that is not of its type stays text
        return text

    def _schema_type(self, function: str, key: str) -> Any:
        for tool in self.tools:
            if tool.get("name") == function:
                prop = ((tool.get("parameters") or {}).get("properties") or {}).get(key) or {}
                return prop.get("type")
        return None
