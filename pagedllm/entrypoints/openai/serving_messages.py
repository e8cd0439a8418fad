"""POST /v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens, on the chat path:
the request becomes a chat completion request (system, text, tool_use and tool_result blocks as
chat messages; tools and tool_choice as chat's), OpenAIServingChat runs it (template, tool and
reasoning parsers, sampling), and its answer comes back in Anthropic's shape: content blocks
(thinking, text, tool_use), stop_reason end_turn / max_tokens / stop_sequence / tool_use, and
usage. Streams: serving_messages_stream.py."""
from __future__ import annotations

import json

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatCompletionResponse, random_id
from pagedllm.entrypoints.openai.protocol_anthropic import CountTokensRequest, MessagesRequest, message_head, stop_reason
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_engine import JSONBody, OpenAIError, renamed_error
from pagedllm.entrypoints.openai.serving_messages_stream import anthropic_events

# chat's field names -> Anthropic's, in the errors the chat path raises
_RENAMES = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens"}


def _block_text(blocks, where: str) -> str:
    if isinstance(blocks, str) or blocks is None:
        return blocks or ""
    return "\n".join(b.text for b in blocks)


def chat_messages(req: CountTokensRequest) -> list[dict]:
    """Anthropic's system and messages as chat messages: a user turn's tool_result blocks become
    `tool` messages (before its text), an assistant's tool_use blocks its tool_calls."""
    out = []
    if req.system is not None:
        out.append({"role": "system", "content": _block_text(req.system, "system")})
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts, calls, results = [], [], []
        for j, b in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if b.type in ("thinking", "redacted_thinking"):
                continue
            if b.type not in ("text", "tool_use", "tool_result"):
                raise OpenAIError(f"{where}: content blocks of type {b.type!r} are not supported "
                                  "(text, tool_use, tool_result)", param="messages")
            if b.type == "tool_use" and m.role != "assistant" or b.type == "tool_result" and m.role != "user":
                raise OpenAIError(f"{where}: a {b.type} block cannot be in a {m.role} message", param="messages")
            if b.type == "text":
                if b.text is None:
                    raise OpenAIError(f"{where}: a text block needs text", param="messages")
                texts.append(b.text)
            elif b.type == "tool_use":
                if not b.id or not b.name:
                    raise OpenAIError(f"{where}: a tool_use block needs id and name", param="messages")
                calls.append({"id": b.id, "type": "function",
                              "function": {"name": b.name, "arguments": json.dumps(b.input or {})}})
            else:
                if not b.tool_use_id:
                    raise OpenAIError(f"{where}: a tool_result block needs tool_use_id", param="messages")
                results.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                "content": _block_text(b.content, where)})
        out += results
        if texts or calls or not results:
            msg = {"role": m.role, "content": "\n".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def _tool_fields(req: CountTokensRequest) -> dict:
    if not req.tools:
        if req.tool_choice is not None and req.tool_choice.type != "none":
            raise OpenAIError(f"tool_choice {req.tool_choice.type!r} needs tools", param="tool_choice")
        return {}
    tc = req.tool_choice
    fields = {"tools": [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                          "parameters": t.input_schema}} for t in req.tools]}
    if tc is not None:
        if tc.type == "tool":
            if not tc.name:
                raise OpenAIError("tool_choice of type 'tool' needs name", param="tool_choice")
            fields["tool_choice"] = {"type": "function", "function": {"name": tc.name}}
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[tc.type]
        fields["parallel_tool_calls"] = not tc.disable_parallel_tool_use
    return fields


def chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    if req.max_tokens < 1:
        raise OpenAIError(f"max_tokens must be an integer >= 1, got {req.max_tokens}", param="max_tokens")
    return ChatCompletionRequest.model_validate(dict(
        model=req.model, messages=chat_messages(req), max_tokens=req.max_tokens, stop=req.stop_sequences,
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, stream=req.stream,
        stream_options={"include_usage": True, "continuous_usage_stats": True} if req.stream else None, **_tool_fields(req)))


def tool_input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class AnthropicServingMessages:
    """Anthropic's Messages API in front of the chat serving object (its models, template and
    parsers)."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_message(self, req: MessagesRequest, raw_request=None):
        try:
            chat_req = chat_request(req)
            result = await self.chat.create_chat_completion(chat_req, raw_request)
        except OpenAIError as e:
            raise renamed_error(e, _RENAMES) from None
        if req.stream:
            return anthropic_events(result, random_id("msg"), self.chat.model_name)
        return self._message(result)

    def _message(self, res: ChatCompletionResponse) -> JSONBody:
        choice = res.choices[0]
        m = choice.message
        content = []
        if m.reasoning_content:
            content.append({"type": "thinking", "thinking": m.reasoning_content, "signature": ""})
        if m.content:
            content.append({"type": "text", "text": m.content})
        for c in m.tool_calls or []:
            content.append({"type": "tool_use", "id": c.id, "name": c.function.name,
                            "input": tool_input(c.function.arguments)})
        body = message_head(random_id("msg"), res.model, res.usage.prompt_tokens)
        reason, seq = stop_reason(choice.finish_reason, choice.stop_reason)
        body.update(content=content, stop_reason=reason, stop_sequence=seq)
        body["usage"]["output_tokens"] = res.usage.completion_tokens
        return JSONBody(body)

    async def count_tokens(self, req: CountTokensRequest, raw_request=None) -> JSONBody:
        """{"input_tokens": the prompt's length}: the conversation through the chat template
        with the tools, as /v1/messages would render it."""
        chat = self.chat
        chat.check_model(req.model)
        creq = ChatCompletionRequest.model_validate({"messages": chat_messages(req), **_tool_fields(req)})
        tools = None if creq.tool_choice == "none" or not creq.tools else \
            [t.function.model_dump(exclude_none=True) for t in creq.tools]
        ids = chat.prompt_ids(chat.conversation(creq.messages), True, False, tools)
        return JSONBody(input_tokens=len(ids))
