"""POST /v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens, on the chat path:
the request becomes a chat completion request (system, text, image, tool_use and tool_result
blocks as chat messages, an image block as chat's image_url part whose 400s are renamed to name
the block; tools and tool_choice as chat's), OpenAIServingChat runs it (template, tool and
reasoning parsers, sampling), and its answer comes back in Anthropic's shape: content blocks
(thinking, text, tool_use), stop_reason end_turn / max_tokens / stop_sequence / tool_use, and
usage. Streams: serving_messages_stream.py."""

from __future__ import annotations

import json

from pagedllm.entrypoints.openai.image_parts import ImagePaths
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatCompletionResponse, random_id
from pagedllm.entrypoints.openai.protocol_anthropic import (
    CountTokensRequest,
    MessagesRequest,
    message_head,
    stop_reason,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.multimodal.chat import has_image_parts
from pagedllm.entrypoints.openai.serving_engine import JSONBody, OpenAIError, renamed_error
from pagedllm.entrypoints.openai.serving_messages_stream import anthropic_events

# chat's field names -> Anthropic's, in the errors the chat path raises
_RENAMES = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens"}
# Anthropic's media types for base64 images
MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


def _block_text(blocks, where: str) -> str:
    if isinstance(blocks, str) or blocks is None:
        return blocks or ""
    return "\n".join(b.text for b in blocks)


def _image_url(b, where: str) -> tuple[str, str]:
    """(chat's URL, the field that holds it) of an image block: base64 data as a data: URL."""
    src = b.source
    if src is None:
        raise OpenAIError(f"{where}: an image block needs source", param="messages")
    if src.type == "base64":
        if src.media_type not in MEDIA_TYPES:
            raise OpenAIError(
                f"{where}.source.media_type must be one of {', '.join(MEDIA_TYPES)}, got {src.media_type!r}",
                param="messages",
            )
        if not src.data:
            raise OpenAIError(f"{where}.source: a base64 source needs data", param="messages")
        return f"data:{src.media_type};base64,{src.data}", f"{where}.source.data"
    if src.type == "url":
        if not src.url:
            raise OpenAIError(f"{where}.source: a url source needs url", param="messages")
        return src.url, f"{where}.source.url"
    raise OpenAIError(f"{where}.source.type {src.type!r} is not supported (base64, url)", param="messages")


def _content(parts: list, chat_where: str, paths: ImagePaths):
    """A message's text blocks joined, or with images chat's text and image_url parts in order.
    parts: text, or (URL, the block's path, the URL's field) of an image."""
    if all(isinstance(p, str) for p in parts):
        return "\n".join(parts)
    return [
        {"type": "text", "text": p}
        if isinstance(p, str)
        else paths.part(p[0], f"{chat_where}.content[{i}]", p[1], p[2])
        for i, p in enumerate(parts)
    ]


def chat_messages(req: CountTokensRequest, paths: ImagePaths) -> list[dict]:
    """Anthropic's system and messages as chat messages: a user turn's tool_result blocks become
    `tool` messages (before its text and images), an assistant's tool_use blocks its tool_calls."""
    out = []
    if req.system is not None:
        out.append({"role": "system", "content": _block_text(req.system, "system")})
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        parts, calls, results = [], [], []
        for j, b in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if b.type in ("thinking", "redacted_thinking"):
                continue
            if b.type not in ("text", "image", "tool_use", "tool_result"):
                raise OpenAIError(
                    f"{where}: content blocks of type {b.type!r} are not supported "
                    "(text, image, tool_use, tool_result)",
                    param="messages",
                )
            if (
                b.type == "tool_use"
                and m.role != "assistant"
                or b.type in ("tool_result", "image")
                and m.role != "user"
            ):
                raise OpenAIError(f"{where}: {b.type} blocks cannot be in {m.role} messages", param="messages")
            if b.type == "text":
                if b.text is None:
                    raise OpenAIError(f"{where}: a text block needs text", param="messages")
                parts.append(b.text)
            elif b.type == "image":
                url, field = _image_url(b, where)
                parts.append((url, where, field))
            elif b.type == "tool_use":
                if not b.id or not b.name:
                    raise OpenAIError(f"{where}: a tool_use block needs id and name", param="messages")
                calls.append(
                    {
                        "id": b.id,
                        "type": "function",
                        "function": {"name": b.name, "arguments": json.dumps(b.input or {})},
                    }
                )
            else:
                if not b.tool_use_id:
                    raise OpenAIError(f"{where}: a tool_result block needs tool_use_id", param="messages")
                results.append(
                    {"role": "tool", "tool_call_id": b.tool_use_id, "content": _block_text(b.content, where)}
                )
        out += results
        if parts or calls or not results:
            msg = {"role": m.role, "content": _content(parts, f"messages[{len(out)}]", paths)}
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
    fields = {
        "tools": [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }
            for t in req.tools
        ]
    }
    if tc is not None:
        if tc.type == "tool":
            if not tc.name:
                raise OpenAIError("tool_choice of type 'tool' needs name", param="tool_choice")
            fields["tool_choice"] = {"type": "function", "function": {"name": tc.name}}
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[tc.type]
        fields["parallel_tool_calls"] = not tc.disable_parallel_tool_use
    return fields


def chat_request(req: MessagesRequest, paths: ImagePaths) -> ChatCompletionRequest:
    if req.max_tokens < 1:
        raise OpenAIError(f"max_tokens must be an integer >= 1, got {req.max_tokens}", param="max_tokens")
    return ChatCompletionRequest.model_validate(
        dict(
            model=req.model,
            messages=chat_messages(req, paths),
            max_tokens=req.max_tokens,
            stop=req.stop_sequences,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            stream=req.stream,
            stream_options={"include_usage": True, "continuous_usage_stats": True} if req.stream else None,
            **_tool_fields(req),
        )
    )


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
        paths = ImagePaths()
        try:
            chat_req = chat_request(req, paths)
            result = await self.chat.create_chat_completion(chat_req, raw_request)
        except OpenAIError as e:
            raise renamed_error(e, {**_RENAMES, **paths}) from None
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
            content.append(
                {"type": "tool_use", "id": c.id, "name": c.function.name, "input": tool_input(c.function.arguments)}
            )
        body = message_head(random_id("msg"), res.model, res.usage.prompt_tokens)
        reason, seq = stop_reason(choice.finish_reason, choice.stop_reason)
        body.update(content=content, stop_reason=reason, stop_sequence=seq)
        body["usage"]["output_tokens"] = res.usage.completion_tokens
        return JSONBody(body)

    async def count_tokens(self, req: CountTokensRequest, raw_request=None) -> JSONBody:
        """{"input_tokens": the prompt's length}: the conversation through the chat template
        with the tools, as /v1/messages would render it (each image's placeholder tokens
        expanded by the model's processor)."""
        chat, paths = self.chat, ImagePaths()
        chat.check_model(req.model)
        try:
            creq = ChatCompletionRequest.model_validate({"messages": chat_messages(req, paths), **_tool_fields(req)})
            tools = (
                None
                if creq.tool_choice == "none" or not creq.tools
                else [t.function.model_dump(exclude_none=True) for t in creq.tools]
            )
            conv = chat.conversation(creq.messages, images=True)
            if has_image_parts(conv):
                ids = (await chat.image_prompt(conv, creq, tools)).token_ids
            else:
                ids = chat.prompt_ids(conv, True, False, tools)
        except OpenAIError as e:
            raise renamed_error(e, paths) from None
        return JSONBody(input_tokens=len(ids))
