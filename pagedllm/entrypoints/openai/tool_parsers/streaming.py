"""One chat choice's output split into reasoning, content and tool calls: whole (`final`), or as
stream deltas (`delta`). A delta only says what can no longer change: the parsers hold back a
tail that may begin a tag, and a call's arguments are sent as the stable prefix of their JSON
text (partial containers closed by partial-json-parser, unfinished scalars left out, closing
brackets held back), so the fragments always concatenate to the final arguments.

An output cut by max_tokens (`truncated`) keeps what it holds, as OpenAI's API does: the calls
named so far, the last with the stable prefix of its arguments (what the stream sent); cut
before any call was named, the text itself is the content."""

from __future__ import annotations

import json
from typing import Optional

from pagedllm.entrypoints.openai.protocol import FunctionCall, ToolCall, random_id
from pagedllm.entrypoints.openai.tool_parsers.abstract import ParsedCall, ParsedOutput, ToolParser


def arguments_text(call: ParsedCall) -> str:
    """The call's arguments as JSON text; while incomplete, only the prefix that cannot change."""
    if call.arguments is None:
        return ""
    text = json.dumps(call.arguments, ensure_ascii=False)
    return text if call.complete else text.rstrip("}]")


def _num_named(parsed: ParsedOutput) -> int:
    return sum(c.name is not None for c in parsed.calls)


class ChatOutputParser:
    def __init__(self, reasoning_parser=None, tool_parser: Optional[ToolParser] = None) -> None:
        self.reasoning_parser, self.tool_parser = reasoning_parser, tool_parser
        self.text = ""
        self.sent_reasoning = self.sent_content = 0
        self.sent_calls: list[list[str]] = []  # per call: [id, arguments sent]

    def parse(self, text: str, partial: bool, truncated: bool = False) -> tuple[Optional[str], ParsedOutput]:
        reasoning, content = self.reasoning_parser.extract(text, partial) if self.reasoning_parser else (None, text)
        if self.tool_parser is None:
            return reasoning, ParsedOutput(content)
        parsed = self.tool_parser.extract(content, partial)
        if truncated:
            # What parses whole stays whole; else the calls named so far, the last one's
            # arguments as far as they are certain; cut before any name, the text as it is.
            cut = self.tool_parser.extract(content, partial=True)
            if _num_named(cut) > _num_named(parsed):
                parsed = cut
            if not _num_named(parsed):
                parsed = ParsedOutput(content)
        return reasoning, parsed

    def final(self, text: str, truncated: bool = False) -> tuple[Optional[str], Optional[str], list[ToolCall]]:
        """(reasoning_content, content, tool_calls) of a whole output (`truncated`: cut by max_tokens)."""
        reasoning, parsed = self.parse(text, partial=False, truncated=truncated)
        calls = [
            ToolCall(function=FunctionCall(name=c.name, arguments=arguments_text(c)))
            for c in parsed.calls
            if c.name is not None
        ]
        content = parsed.content if parsed.content or not calls else None
        return reasoning, content, calls

    def delta(self, new_text: str, finished: bool, truncated: bool = False) -> dict:
        """The chat delta for `new_text` (reasoning_content, content, tool_calls; {} if none yet)."""
        self.text += new_text
        reasoning, parsed = self.parse(self.text, partial=not finished, truncated=truncated)
        delta: dict = {}
        if reasoning is not None and len(reasoning) > self.sent_reasoning:
            delta["reasoning_content"] = reasoning[self.sent_reasoning :]
            self.sent_reasoning = len(reasoning)
        if len(parsed.content) > self.sent_content:
            delta["content"] = parsed.content[self.sent_content :]
            self.sent_content = len(parsed.content)
        calls = []
        for i, call in enumerate(parsed.calls):
            if i == len(self.sent_calls):
                if call.name is None:
                    break
                self.sent_calls.append([random_id("call"), ""])
                calls.append(
                    {
                        "index": i,
                        "id": self.sent_calls[i][0],
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            sent = self.sent_calls[i][1]
            args = arguments_text(call)
            if len(args) > len(sent) and args.startswith(sent):
                self.sent_calls[i][1] = args
                if calls and calls[-1]["index"] == i:
                    calls[-1]["function"]["arguments"] = args[len(sent) :]
                else:
                    calls.append({"index": i, "function": {"arguments": args[len(sent) :]}})
        if calls:
            delta["tool_calls"] = calls
        return delta

    @property
    def called_tools(self) -> bool:
        return bool(self.sent_calls)
