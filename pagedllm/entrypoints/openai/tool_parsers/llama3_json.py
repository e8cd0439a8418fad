"""Llama 3 JSON format: the whole answer is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`; several calls separated by `; `)."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract import ParsedOutput, ToolParser, call_from, loads

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    def extract(self, text: str, partial: bool) -> ParsedOutput:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :].lstrip()
        if not body.startswith("{"):
            # Not (yet) a call: text, unless it may still become the tag.
            return ParsedOutput("" if partial and PYTHON_TAG.startswith(body) else text)
        parts = body.split("; {")
        out = ParsedOutput()
        for i, part in enumerate(parts):
            part = part if i == 0 else "{" + part
            last = i == len(parts) - 1
            complete = not (partial and last)
            call = call_from(loads(part, partial=not complete), "parameters", complete)
            if call is None and complete:
                return ParsedOutput(text)  # not calls after all
            if call is not None:
                out.calls.append(call)
        return out
