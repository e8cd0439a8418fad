"""Hermes format (Qwen, Hermes, many others): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks after optional text."""

from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_parsers.abstract import ParsedOutput, ToolParser, call_from, held_back, loads

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    def extract(self, text: str, partial: bool) -> ParsedOutput:
        head, sep, rest = text.partition(START)
        if partial and not sep:  # a tail that may begin a call, or the space before one, waits
            head = head[: len(head) - held_back(head, START)].rstrip()
        out = ParsedOutput(content=head if not sep else head.rstrip())
        blocks = rest.split(START) if sep else []
        for block in blocks:
            body, closed, _ = block.partition(END)
            complete = bool(closed) or not partial
            call = call_from(loads(body, partial=not complete), "arguments", complete)
            if call is None:
                if complete:  # not a call after all: the text stays text
                    out.content += START + block
                continue
            out.calls.append(call)
        return out


def tools_system_prompt(tools: list[dict]) -> str:
    """The Hermes tool-use instructions, for a chat template that does not render `tools`."""
    listed = "\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{listed}\n</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def render_tool_messages(conv: list[dict]) -> list[dict]:
    """The history in Hermes text for a template that knows only role and content: an
    assistant's calls as <tool_call> blocks, a tool's result in <tool_response>."""
    out = []
    for m in conv:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        m.pop("tool_call_id", None)
        if calls:
            blocks = [
                f"{START}\n"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False
                )
                + f"\n{END}"
                for c in calls
            ]
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
        if m["role"] == "tool":
            m["content"] = f"<tool_response>\n{m['content']}\n</tool_response>"
        out.append(m)
    return out
