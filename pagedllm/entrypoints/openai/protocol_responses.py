"""The Responses API's request body (the subset pagedllm serves) as pydantic models, strict as the
other OpenAI models (protocol.py), unknown fields ignored; and the answer's pieces (output items,
usage, the response object), built here because whole and streamed answers share them."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from pydantic import Field, StrictBool, StrictInt, StrictStr

from pagedllm.entrypoints.openai.protocol import INT64_MAX, INT64_MIN, Number, OpenAIBaseModel, StructuredOutputsField


# ------------------------------------------------------------------ the request
class ResponseInputContent(OpenAIBaseModel):
    """A part of an input message (input_text, input_image, or output_text of an earlier answer),
    of a function_call_output's output, or of a reasoning item."""

    type: StrictStr
    text: Optional[StrictStr] = None
    image_url: Optional[StrictStr] = None  # input_image: a data:, file:// or http(s) URL
    file_id: Optional[StrictStr] = None  # input_image: refused (no file store)
    detail: Optional[StrictStr] = None  # input_image: "low" / "high" / "auto"; the processor decides


class ResponseInputItem(OpenAIBaseModel):
    """An item of `input`: a message (type "message" or absent), an earlier answer's
    function_call, the function_call_output that answers it, or a reasoning item (dropped, as
    chat templates drop earlier thinking). Which fields each needs: serving_responses.py."""

    type: Optional[StrictStr] = None
    role: Optional[StrictStr] = None
    content: Optional[Union[StrictStr, list[ResponseInputContent]]] = None
    call_id: Optional[StrictStr] = None  # function_call(_output)
    name: Optional[StrictStr] = None  # function_call
    arguments: Optional[StrictStr] = None  # function_call: JSON text
    output: Optional[Union[StrictStr, list[ResponseInputContent]]] = None  # function_call_output


class FunctionTool(OpenAIBaseModel):
    """A function the model may call (the Responses API's flat shape, not chat's nested one)."""

    type: Literal["function"]
    name: StrictStr = Field(min_length=1, max_length=64)
    description: Optional[StrictStr] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[StrictBool] = None


class FunctionToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    name: StrictStr


class TextFormat(OpenAIBaseModel):
    type: Literal["text", "json_schema", "json_object"]
    name: Optional[StrictStr] = None
    description: Optional[StrictStr] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[StrictBool] = None


class TextConfig(OpenAIBaseModel):
    format: Optional[TextFormat] = None


class ReasoningConfig(OpenAIBaseModel):
    """How much to think: the chat template's enable_thinking (off for "none") and reasoning_effort,
    as vLLM passes them."""

    effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None
    summary: Optional[StrictStr] = None


class ResponsesRequest(OpenAIBaseModel):
    model: Optional[StrictStr] = None
    input: Union[StrictStr, list[ResponseInputItem]]
    instructions: Optional[StrictStr] = None
    max_output_tokens: Optional[StrictInt] = None
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    stream: Optional[StrictBool] = False
    previous_response_id: Optional[StrictStr] = None
    # OpenAI's default is to store; kept only where the server's store is on (envs.py), as vLLM.
    store: Optional[StrictBool] = True
    text: Optional[TextConfig] = None
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], FunctionToolChoice]] = None
    parallel_tool_calls: StrictBool = True
    reasoning: Optional[ReasoningConfig] = None
    top_logprobs: Optional[StrictInt] = None
    metadata: Optional[dict[str, StrictStr]] = None
    user: Optional[StrictStr] = None
    # Extras (vLLM's names), as on the other endpoints.
    seed: Optional[StrictInt] = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    top_k: Optional[StrictInt] = None
    structured_outputs: Optional[StructuredOutputsField] = None
    priority: StrictInt = 0


# ------------------------------------------------------------------ the answer
def hex_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def text_item(kind: str, item_id: str, text: str, status: str) -> dict:
    """A `message` (the answer's text) or `reasoning` (its thinking) item; in progress, no parts yet."""
    if kind == "message":
        parts = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {
            "id": item_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": parts if status != "in_progress" else [],
        }
    parts = [{"type": "reasoning_text", "text": text}]
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "status": status,
        "content": parts if status != "in_progress" else [],
    }


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def status_of(finish_reason: Optional[str]) -> str:
    """As OpenAI's API: an answer the length cap ended is incomplete."""
    return "incomplete" if finish_reason == "length" else "completed"


def usage_of(prompt: int, gen: int, cached: int) -> dict:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": gen,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + gen,
    }


def assistant_turn(items: list[dict]) -> dict:
    """The answer as the chat message that carries it into a later turn (previous_response_id):
    its text and its calls (call_id as the call's id); the thinking is dropped."""
    text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    calls = [
        {"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
        for it in items
        if it["type"] == "function_call"
    ]
    if calls:
        msg["tool_calls"] = calls
    return msg


@dataclass
class ResponseHead:
    """What every state of one response shares: its id, the request's echoed fields."""

    req: ResponsesRequest
    model: str
    store: bool  # whether it is kept (asked for and the server's store is on)
    id: str = field(default_factory=lambda: hex_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(self, status: str, output: list[dict], usage: Optional[dict] = None) -> dict[str, Any]:
        req, done = self.req, status != "in_progress"
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if done else None,
            "model": self.model,
            "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "error": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "parallel_tool_calls": req.parallel_tool_calls,
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": tools,
            "previous_response_id": req.previous_response_id,
            "store": self.store,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "truncation": "disabled",
            "metadata": req.metadata or {},
            "user": req.user,
            "usage": usage,
            "reasoning": req.reasoning.model_dump() if req.reasoning is not None else None,
        }
