"""Anthropic's streaming events from the chat path's chunks: message_start, a ping, then per
content block (thinking, text, each tool_use) content_block_start, its deltas (thinking_delta,
text_delta, input_json_delta) and content_block_stop, then message_delta (stop_reason, usage)
and message_stop. An error after the stream began is an `error` event."""

from __future__ import annotations

import json
from typing import AsyncIterator, Optional

from pagedllm.entrypoints.openai.errors import anthropic_error_body
from pagedllm.entrypoints.openai.protocol_anthropic import message_head, stop_reason
from pagedllm.entrypoints.openai.serving_engine import sse_chunks


def event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


def error_event(error: dict) -> str:
    return event("error", anthropic_error_body(error.get("message", "error"), error.get("type")))


class _Blocks:
    """The content blocks opened so far: a new kind (or a new tool call) closes the open one."""

    def __init__(self) -> None:
        self.index = -1
        self.key: Optional[tuple] = None

    def open(self, key: tuple, block: dict) -> list[str]:
        if key == self.key:
            return []
        out = self.close()
        self.index += 1
        self.key = key
        return out + [
            event("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})
        ]

    def delta(self, delta: dict) -> str:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def close(self) -> list[str]:
        if self.key is None:
            return []
        self.key = None
        return [event("content_block_stop", {"type": "content_block_stop", "index": self.index})]


def _delta_events(blocks: _Blocks, delta: dict) -> list[str]:
    out = []
    if delta.get("reasoning_content"):
        out += blocks.open(("thinking",), {"type": "thinking", "thinking": "", "signature": ""})
        out.append(blocks.delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
    if delta.get("content"):
        out += blocks.open(("text",), {"type": "text", "text": ""})
        out.append(blocks.delta({"type": "text_delta", "text": delta["content"]}))
    for call in delta.get("tool_calls") or []:
        fn = call.get("function") or {}
        if call.get("id"):  # a call's first delta: its id and name
            out += blocks.open(
                ("tool_use", call.get("index")),
                {"type": "tool_use", "id": call["id"], "name": fn.get("name"), "input": {}},
            )
        if fn.get("arguments"):
            out.append(blocks.delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
    return out


async def anthropic_events(chat_stream: AsyncIterator[str], msg_id: str, model: str) -> AsyncIterator[str]:
    blocks = _Blocks()
    started = False
    reason, seq, usage = None, None, {"prompt_tokens": 0, "completion_tokens": 0}
    async for chunk in sse_chunks(chat_stream):
        if chunk is None:
            break
        if "error" in chunk:
            yield error_event(chunk["error"])
            return
        usage = chunk.get("usage") or usage  # continuous usage: the prompt's length from the first chunk
        if not started:
            started = True
            yield event(
                "message_start",
                {"type": "message_start", "message": message_head(msg_id, model, usage["prompt_tokens"])},
            )
            yield event("ping", {"type": "ping"})
        for c in chunk.get("choices", []):
            for e in _delta_events(blocks, c.get("delta") or {}):
                yield e
            if c.get("finish_reason"):
                reason, seq = stop_reason(c["finish_reason"], c.get("stop_reason"))
    for e in blocks.close():
        yield e
    yield event(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": reason or "end_turn", "stop_sequence": seq},
            "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]},
        },
    )
    yield event("message_stop", {"type": "message_stop"})
