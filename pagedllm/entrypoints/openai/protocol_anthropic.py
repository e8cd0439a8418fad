"""Anthropic's Messages API request bodies (the subset pagedllm serves), as pydantic models:
strict types as the OpenAI models (protocol.py), unknown fields ignored. `max_tokens` is
required, as Anthropic has it; /v1/messages/count_tokens takes the same body without it. The
answer's head and stop reason are built here too (whole and streamed answers share them)."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field, StrictBool, StrictInt, StrictStr

from pagedllm.entrypoints.openai.protocol import Number, OpenAIBaseModel


class TextBlock(OpenAIBaseModel):
    type: Literal["text"]
    text: StrictStr


class BlockSource(OpenAIBaseModel):
    """An image block's source: {"type": "base64", "media_type", "data"} or {"type": "url", "url"}
    (checked in serving_messages.py, naming the field)."""

    type: StrictStr
    media_type: Optional[StrictStr] = None
    data: Optional[StrictStr] = None
    url: Optional[StrictStr] = None


class ContentBlock(OpenAIBaseModel):
    """One block of a message: text, a user's image, an assistant's tool_use, a user's tool_result
    (thinking blocks of an earlier assistant turn are accepted and dropped, as templates drop them)."""

    type: Literal["text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image", "document"]
    text: Optional[StrictStr] = None
    id: Optional[StrictStr] = None  # tool_use
    name: Optional[StrictStr] = None
    input: Optional[dict[str, Any]] = None
    tool_use_id: Optional[StrictStr] = None  # tool_result
    content: Optional[Union[StrictStr, list[TextBlock]]] = None
    is_error: Optional[StrictBool] = None
    source: Optional[BlockSource] = None  # image


class AnthropicMessage(OpenAIBaseModel):
    role: Literal["user", "assistant"]
    content: Union[StrictStr, list[ContentBlock]]


class AnthropicTool(OpenAIBaseModel):
    name: StrictStr = Field(min_length=1, max_length=64)
    description: Optional[StrictStr] = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(OpenAIBaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[StrictStr] = None
    disable_parallel_tool_use: Optional[StrictBool] = None


class CountTokensRequest(OpenAIBaseModel):
    model: StrictStr
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Optional[Union[StrictStr, list[TextBlock]]] = None
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[AnthropicToolChoice] = None


class MessagesRequest(CountTokensRequest):
    max_tokens: StrictInt
    stop_sequences: Optional[list[StrictStr]] = None
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    top_k: Optional[StrictInt] = None
    stream: StrictBool = False
    metadata: Optional[dict[str, Any]] = None


def stop_reason(finish_reason: Optional[str], matched) -> tuple[str, Optional[str]]:
    """(Anthropic's stop_reason, the stop sequence met) for chat's finish reason and stop_reason
    (the matched stop string, or a stop token's id)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def message_head(msg_id: str, model: str, input_tokens: int) -> dict:
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": 0},
    }
