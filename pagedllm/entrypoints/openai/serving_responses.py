"""POST /v1/responses on the chat path, as /v1/messages is: `instructions` (a system message), the
stored conversation of `previous_response_id`, and `input` (text, messages, function_call and
function_call_output items; a message's input_image parts as chat's image_url parts, whose 400s
are renamed to name the input_image) become a chat completion request, with `tools` / `tool_choice` /
`text.format` as chat's; OpenAIServingChat runs it (template, tool and reasoning parsers,
sampling, the grammar that forces a required or named call), and its answer comes back as output
items: `reasoning`, `message`, `function_call`. Streams: serving_responses_stream.py.

With `store` (OpenAI's default) and the server's store on (PAGEDLLM_ENABLE_RESPONSES_API_STORE,
vLLM's rule: off, `store` is ignored), the response is kept with its conversation
(response_store.py): GET / DELETE /v1/responses/{id}, and previous_response_id carries it on."""

from __future__ import annotations

from pydantic import ValidationError

from pagedllm import envs
from pagedllm.entrypoints.llm import check_role
from pagedllm.entrypoints.openai.image_parts import ImagePaths
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatCompletionResponse
from pagedllm.entrypoints.openai.protocol_responses import (
    ResponseHead,
    ResponseInputItem,
    ResponsesRequest,
    assistant_turn,
    function_call_item,
    hex_id,
    status_of,
    text_item,
    usage_of,
)
from pagedllm.entrypoints.openai.response_store import ResponseStore
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_engine import JSONBody, OpenAIError, bad_input_is_400, renamed_error
from pagedllm.entrypoints.openai.serving_responses_stream import responses_events

# chat's field names -> the Responses API's, in the errors the chat path raises
_RENAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def _text(parts, where: str) -> str:
    """A string, or text parts joined; 400 naming `input` for another kind of part."""
    if parts is None or isinstance(parts, str):
        return parts or ""
    bad = [p.type for p in parts if p.type not in _TEXT_PARTS or p.text is None]
    if bad:
        raise OpenAIError(
            f"{where}: content of type {bad[0]!r} is not supported (input_text; input_image in a message)",
            param="input",
        )
    return "\n".join(p.text for p in parts)


def _content(parts, where: str, chat_where: str, paths: ImagePaths):
    """A message's content for chat: its text, or with input_image parts chat's text and image_url
    parts in their order (`image_url`: a data:, file:// or http(s) URL, as chat's)."""
    if parts is None or isinstance(parts, str) or all(p.type != "input_image" for p in parts):
        return _text(parts, where)
    out = []
    for j, p in enumerate(parts):
        at = f"{where}.content[{j}]"
        if p.type != "input_image":
            out.append({"type": "text", "text": _text([p], where)})
        elif p.image_url is None:
            why = " (file_id is not supported: there is no file store)" if p.file_id is not None else ""
            raise OpenAIError(
                f"{at}: an input_image part needs image_url, a data:, file:// or http(s) URL{why}", param=at
            )
        else:
            out.append(paths.part(p.image_url, f"{chat_where}.content[{j}]", at, f"{at}.image_url"))
    return out


def _needs(item: ResponseInputItem, where: str, *names: str) -> None:
    for name in names:
        if getattr(item, name) is None:
            raise OpenAIError(f"{where}: a {item.type} item needs {name}", param="input")


def input_messages(items, history: list[dict], paths: ImagePaths, first: int = 0) -> list[dict]:
    """`input` as chat messages: a message item as it is, function_call items as the tool_calls of
    an assistant message (the one before them, or a new one), a function_call_output as a tool
    message answering a call made earlier (in `history` or in `input`); reasoning is dropped.
    `first`: the index of the first of them among the chat request's messages (for `paths`)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise OpenAIError("input must not be an empty list", param="input")
    out: list[dict] = []
    calls = {c["id"] for m in history for c in m.get("tool_calls", ())}
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if item.type in (None, "message"):
            if item.role is None:
                raise OpenAIError(f"{where}: a message item needs role", param="input")
            with bad_input_is_400():
                check_role(item.role, f"{where}.role")
            out.append(
                {"role": item.role, "content": _content(item.content, where, f"messages[{first + len(out)}]", paths)}
            )
        elif item.type == "function_call":
            _needs(item, where, "call_id", "name", "arguments")
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
            calls.add(item.call_id)
        elif item.type == "function_call_output":
            _needs(item, where, "call_id", "output")
            if item.call_id not in calls:
                raise OpenAIError(
                    f"{where}: no function_call with call_id {item.call_id!r} comes before this "
                    "function_call_output (in input or the previous response)",
                    param="input",
                )
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output, where)})
        elif item.type != "reasoning":
            raise OpenAIError(
                f"{where}: items of type {item.type!r} are not supported (message, function_call, "
                "function_call_output, reasoning)",
                param="input",
            )
    return out


def chat_request(req: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    """The chat completion request that answers `req` over `messages` (the whole conversation)."""
    if req.top_logprobs:
        raise OpenAIError("top_logprobs is not supported on /v1/responses", param="top_logprobs")
    fields = dict(
        model=req.model,
        messages=messages,
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        user=req.user,
        priority=req.priority,
        stream=req.stream,
        stream_options={"include_usage": True} if req.stream else None,
        parallel_tool_calls=req.parallel_tool_calls,
    )
    if req.tools:
        fields["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type", "strict"}, exclude_none=True)}
            for t in req.tools
        ]
    if req.tool_choice is not None:
        tc = req.tool_choice
        fields["tool_choice"] = tc if isinstance(tc, str) else {"type": "function", "function": {"name": tc.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise OpenAIError(
                "text.format of type json_schema needs schema (a JSON schema object)", param="text.format"
            )
        fields["response_format"] = {
            "type": "json_schema",
            "json_schema": fmt.model_dump(by_alias=True, exclude={"type"}, exclude_none=True),
        }
    elif fmt is not None and fmt.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": effort != "none", "reasoning_effort": effort}
    if req.structured_outputs is not None:
        fields["structured_outputs"] = req.structured_outputs.model_dump(by_alias=True, exclude_none=True)
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:  # the fields were checked as the Responses API's: not expected
        raise OpenAIError(f"the request could not be made a chat request: {e.errors()[0]['msg']}") from None


def output_items(res: ChatCompletionResponse) -> list[dict]:
    """The chat answer as output items: its thinking, its text (also when empty, unless it only
    calls), its calls; each completed but the last, which has the response's status."""
    m, status = res.choices[0].message, status_of(res.choices[0].finish_reason)
    items = []
    if m.reasoning_content:
        items.append(text_item("reasoning", hex_id("rs"), m.reasoning_content, "completed"))
    if m.content or not m.tool_calls:
        items.append(text_item("message", hex_id("msg"), m.content or "", "completed"))
    items += [
        function_call_item(hex_id("fc"), c.id, c.function.name, c.function.arguments, "completed") for c in m.tool_calls
    ]
    items[-1]["status"] = status
    return items


class OpenAIServingResponses:
    """The Responses API in front of the chat serving object (its models, template and parsers)."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat
        self.store_enabled = envs.PAGEDLLM_ENABLE_RESPONSES_API_STORE
        self.store = ResponseStore(envs.PAGEDLLM_RESPONSES_STORE_SIZE, envs.PAGEDLLM_RESPONSES_STORE_TTL_S)

    def stored(self, response_id: str, param: str = "response_id") -> tuple[dict, list[dict]]:
        """(body, conversation) of a kept response; 404 (saying why when the store is off)."""
        if not self.store_enabled:
            raise OpenAIError(
                f"no stored response with id {response_id!r}: this server keeps no responses "
                "(set PAGEDLLM_ENABLE_RESPONSES_API_STORE=1 to keep those made with store: true)",
                status=404,
                param=param,
                code="response_not_found",
            )
        return self.store.get(response_id, param)

    def delete(self, response_id: str) -> None:
        self.stored(response_id)
        self.store.delete(response_id)

    async def create_response(self, req: ResponsesRequest, raw_request=None):
        history = (
            [] if req.previous_response_id is None else self.stored(req.previous_response_id, "previous_response_id")[1]
        )
        system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
        paths = ImagePaths()
        turn = input_messages(req.input, history, paths, len(system) + len(history))
        try:  # this turn's instructions only: a stored conversation has none
            result = await self.chat.create_chat_completion(chat_request(req, system + history + turn), raw_request)
        except OpenAIError as e:
            raise renamed_error(e, {**_RENAMES, **paths}) from None
        head = ResponseHead(req, self.chat.model_name, store=req.store is not False and self.store_enabled)

        def finished(body: dict, items: list[dict]) -> dict:
            if head.store:
                self.store.put(body, history + turn + [assistant_turn(items)])
            return body

        if req.stream:
            return responses_events(result, head, finished)
        items = output_items(result)
        u = result.usage
        cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
        body = head.body(
            status_of(result.choices[0].finish_reason), items, usage_of(u.prompt_tokens, u.completion_tokens, cached)
        )
        return JSONBody(finished(body, items))
