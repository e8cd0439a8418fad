"""POST /v1/responses, stateless: `input` (a string, or message items) and `instructions` (a
system message) through the chat template -> one assistant message, whole or streamed as the
Responses events (response.created ... response.completed). With `store: true` the response
and its conversation are kept (response_store.py): GET / DELETE /v1/responses/{id}, and
previous_response_id carries that conversation into the next turn."""
from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Optional

from pagedllm import envs
from pagedllm.engine.output_processor import OutputKind
from pagedllm.entrypoints.llm import check_role
from pagedllm.entrypoints.openai.protocol import ChatMessage, ResponsesRequest
from pagedllm.entrypoints.openai.response_store import ResponseStore
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_engine import JSONBody, OpenAIError, bad_input_is_400, sse, stream_error
from pagedllm.sampling_params import SamplingParams

_RENAMES = {"max_tokens": "max_output_tokens"}   # the engine's names -> the Responses API's
_TEXT_PARTS = ("input_text", "output_text", "text")


def _hex_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OpenAIServingResponses(OpenAIServingChat):
    """The chat machinery (template, context check) behind the Responses API's shapes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.store = ResponseStore(envs.PAGEDLLM_RESPONSES_STORE_SIZE, envs.PAGEDLLM_RESPONSES_STORE_TTL_S)

    # ------------------------------------------------------------ the request
    def messages(self, req: ResponsesRequest) -> list[ChatMessage]:
        """`instructions` then `input` as chat messages; 400 naming `input` for what is not text."""
        msgs = [ChatMessage(role="system", content=req.instructions)] if req.instructions is not None else []
        if isinstance(req.input, str):
            return msgs + [ChatMessage(role="user", content=req.input)]
        if not req.input:
            raise OpenAIError("input must not be an empty list", param="input")
        for i, item in enumerate(req.input):
            if item.type not in (None, "message") or item.role is None:
                raise OpenAIError(f"input[{i}]: only message items (role and content) are supported, "
                                  f"got type {item.type!r}", param="input")
            with bad_input_is_400():
                check_role(item.role, f"input[{i}].role")
            content = item.content
            if isinstance(content, list):
                bad = [p.type for p in content if p.type not in _TEXT_PARTS or p.text is None]
                if bad:
                    raise OpenAIError(f"input[{i}]: content of type {bad[0]!r} is not supported (input_text only)",
                                      param="input")
                content = "\n".join(p.text for p in content)
            msgs.append(ChatMessage(role=item.role, content=content))
        return msgs

    @staticmethod
    def check_unsupported(req: ResponsesRequest) -> None:
        if req.tools:
            raise OpenAIError("tools are not supported", param="tools")
        if req.top_logprobs:
            raise OpenAIError("top_logprobs is not supported on /v1/responses", param="top_logprobs")

    @staticmethod
    def text_format(req: ResponsesRequest) -> Optional[dict]:
        """The seam for structured output: `text.format` json_schema will become the request's
        guided decoding here; until the engine has it, anything but plain text is a 400."""
        fmt = (req.text or {}).get("format") or {"type": "text"}
        if not isinstance(fmt, dict) or fmt.get("type") != "text":
            kind = fmt.get("type") if isinstance(fmt, dict) else fmt
            raise OpenAIError(f"text.format of type {kind!r} is not supported (structured output is not "
                              "available yet): use {'type': 'text'}", param="text.format")
        return None

    def sampling_params(self, req: ResponsesRequest, max_tokens: Optional[int]) -> SamplingParams:
        with bad_input_is_400(_RENAMES):
            return SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                                  top_p=1.0 if req.top_p is None else req.top_p,
                                  top_k=-1 if not req.top_k else req.top_k,
                                  seed=req.seed, max_tokens=max_tokens)

    async def create_response(self, req: ResponsesRequest, raw_request=None):
        self.check_model(req.model)
        self.check_unsupported(req)
        self.text_format(req)
        max_tokens = req.max_output_tokens
        if max_tokens is not None and max_tokens < 1:
            raise OpenAIError(f"max_output_tokens must be an integer >= 1, got {max_tokens}",
                              param="max_output_tokens")
        self.sampling_params(req, max_tokens)   # the values, before the template runs
        history = []
        if req.previous_response_id is not None:
            history = self.store.get(req.previous_response_id, "previous_response_id")[1]
        conv = self.conversation(self.messages(req))
        system = conv[:1] if req.instructions is not None else []   # this turn's instructions only
        conv = system + history + conv[len(system):]
        ids = self.prompt_ids(conv, True, False)
        if not ids:
            raise OpenAIError("the input produced an empty prompt", param="input")
        max_tokens = self.check_context(len(ids), max_tokens, "input")
        params = self.sampling_params(req, max_tokens)
        resp = _Response(req, _hex_id("resp"), self.model_name, len(ids))
        resp.history = conv[len(system):]
        kind = OutputKind.DELTA if req.stream else OutputKind.FINAL_ONLY
        stream = self.engine.add_request({"prompt_token_ids": ids}, params, resp.id, kind,
                                         lora_request=self.lora_request(req.model))
        if req.stream:
            return self._stream(resp, stream)
        async for _, out in self.merge([stream]):
            resp.update(out)
        return JSONBody(self._kept(resp, resp.body(resp.status())))

    def _kept(self, resp: "_Response", body: dict) -> dict:
        """The finished response's body, stored with its conversation when asked."""
        if resp.req.store:
            self.store.put(body, resp.history + [{"role": "assistant", "content": resp.text}])
        return body

    async def _stream(self, resp: "_Response", stream) -> AsyncIterator[str]:
        seq = iter(range(1 << 62))

        def event(type_: str, **fields) -> str:
            return f"event: {type_}\n" + sse({"type": type_, "sequence_number": next(seq), **fields})

        loc = {"item_id": resp.msg_id, "output_index": 0}
        merged = self.merge([stream])
        try:
            yield event("response.created", response=resp.body("in_progress"))
            yield event("response.in_progress", response=resp.body("in_progress"))
            yield event("response.output_item.added", output_index=0, item=resp.message("in_progress", ""))
            yield event("response.content_part.added", **loc, content_index=0, part=_text_part(""))
            async for _, out in merged:
                delta = resp.update(out)
                if delta:
                    yield event("response.output_text.delta", **loc, content_index=0, delta=delta, logprobs=[])
            text = resp.text
            yield event("response.output_text.done", **loc, content_index=0, text=text, logprobs=[])
            yield event("response.content_part.done", **loc, content_index=0, part=_text_part(text))
            status = resp.status()
            yield event("response.output_item.done", output_index=0, item=resp.message(status, text))
            yield event("response.incomplete" if status == "incomplete" else "response.completed",
                        response=self._kept(resp, resp.body(status)))
        except Exception as e:  # the engine died or the server is stopping
            err = stream_error(e)
            yield event("error", code=err.code or err.type, message=err.message, param=err.param)
        finally:
            await merged.aclose()


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class _Response:
    """One response being made: the request's echo fields, the text so far, usage."""

    def __init__(self, req: ResponsesRequest, id_: str, model: str, num_prompt: int) -> None:
        self.req, self.id, self.model, self.num_prompt = req, id_, model, num_prompt
        self.msg_id = _hex_id("msg")
        self.created_at = int(time.time())
        self.text, self.num_gen, self.num_cached = "", 0, 0
        self.finish_reason: Optional[str] = None
        self.history: list[dict] = []   # the conversation (without instructions) that led to it

    def update(self, out) -> str:
        """Take one engine output -> its new text."""
        c = out.outputs[0]
        self.text += c.text
        self.num_gen += len(c.token_ids)
        self.num_cached = out.num_cached_tokens
        self.finish_reason = c.finish_reason or self.finish_reason
        return c.text

    def status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    def message(self, status: str, text: str) -> dict:
        return {"id": self.msg_id, "type": "message", "role": "assistant", "status": status,
                "content": [_text_part(text)] if status != "in_progress" else []}

    def body(self, status: str) -> dict[str, Any]:
        req, done = self.req, status != "in_progress"
        usage = None
        if done:
            usage = {"input_tokens": self.num_prompt,
                     "input_tokens_details": {"cached_tokens": self.num_cached, "cache_write_tokens": 0},
                     "output_tokens": self.num_gen, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": self.num_prompt + self.num_gen}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if done else None, "model": self.model,
            "output": [self.message(status, self.text)] if done else [],
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "error": None, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "parallel_tool_calls": False,
            "tool_choice": "none", "tools": [], "previous_response_id": req.previous_response_id, "store": bool(req.store),
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "metadata": req.metadata or {},
            "user": req.user, "usage": usage,
        }
