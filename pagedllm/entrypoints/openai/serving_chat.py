"""POST /v1/chat/completions: messages through the chat template -> n choices, streamed
(a role delta, then content deltas, then the finish reason) or not. With use_beam_search, the
n best hypotheses of a search of width n, best first."""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

import json
from typing import Optional

from pagedllm.engine.output_processor import OutputKind
from pagedllm.entrypoints.llm import apply_chat_template, check_role
from pagedllm.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprob,
    ChatLogprobContent,
    ChatResponseMessage,
    PromptTokensDetails,
    UsageInfo,
    prompt_logprobs_json,
    usage_dict,
    random_id,
)
from pagedllm.entrypoints.openai.reasoning import REASONING_PARSERS
from pagedllm.multimodal.chat import (
    chat_placeholder,
    has_image_parts,
    image_part_locations,
    split_image_parts,
    template_takes_parts,
)
from pagedllm.multimodal.inputs import ProcessedPrompt
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.forced import NamedToolParser, RequiredToolParser, required_schema
from pagedllm.entrypoints.openai.tool_parsers.hermes import render_tool_messages, tools_system_prompt
from pagedllm.entrypoints.openai.tool_parsers.streaming import ChatOutputParser
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIError,
    OpenAIServing,
    bad_input_is_400,
    sse,
    stream_error,
    stream_final,
)

_RENAMES = {"logprobs": "top_logprobs"}  # the engine's names -> chat's


def _finish_reason(reason: Optional[str], called_tools: bool) -> Optional[str]:
    return "tool_calls" if reason == "stop" and called_tools else reason


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self,
        engine,
        served_model_names,
        chat_template=None,
        enable_auto_tool_choice: bool = False,
        tool_call_parser: Optional[str] = None,
        reasoning_parser: Optional[str] = None,
    ) -> None:
        super().__init__(engine, served_model_names, chat_template)
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_parser_class = TOOL_PARSERS[tool_call_parser] if tool_call_parser else None
        self.reasoning_parser_class = REASONING_PARSERS[reasoning_parser] if reasoning_parser else None
        self._template_renders_tools: Optional[bool] = None
        self._template_takes_parts: Optional[bool] = None

    def conversation(self, req_messages, images: bool = False) -> list[dict]:
        """The messages as the chat template takes them; 400 when their text alone cannot fit
        in the context (checked before the template renders or the tokenizer runs). images: a
        message with image_url parts keeps its parts (image_prompt turns them into placeholders)."""
        conv = []
        for i, m in enumerate(req_messages):
            with bad_input_is_400():
                check_role(m.role, f"messages[{i}].role")
            if images and m.has_images():
                text = [p.model_dump(exclude_none=True) for p in m.content]
            else:
                try:
                    text = m.text()
                except ValueError as e:
                    raise OpenAIError(str(e), param="messages") from None
            msg = {"role": m.role, "content": text if text is not None else ""}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_calls:  # templates take the arguments as an object
                msg["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)},
                    }
                    for c in m.tool_calls
                ]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            conv.append(msg)
        with bad_input_is_400():
            self.engine.processor.check_messages_chars(conv)
        return conv

    def prompt_ids(
        self,
        conv: list[dict],
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: Optional[list[dict]] = None,
        template_kwargs: Optional[dict] = None,
        tokenize: bool = True,
    ):
        """Token ids of the conversation (its text: tokenize=False); `tools` go to the template, or,
        where it does not render them (the default model's ChatML), into a Hermes system block with
        the calls as text."""
        kwargs = dict(template_kwargs or {})
        if tools:
            if self.renders_tools():
                kwargs["tools"] = [{"type": "function", "function": t} for t in tools]
            else:
                conv = render_tool_messages(conv)
                block = tools_system_prompt(tools)
                if conv and conv[0]["role"] == "system":
                    conv = [{**conv[0], "content": conv[0]["content"] + "\n\n" + block}] + conv[1:]
                else:
                    conv = [{"role": "system", "content": block}] + conv
        try:
            return apply_chat_template(
                self.tokenizer,
                conv,
                add_generation_prompt,
                self.chat_template,
                continue_final_message,
                tokenize,
                **kwargs,
            )
        except Exception as e:  # ValueError, jinja2 errors (raise_exception in templates), ...
            raise OpenAIError(
                f"the chat template could not be applied to the messages: {e}", param="messages"
            ) from None

    def template_takes_parts(self) -> bool:
        """Whether the chat template iterates over content parts (multimodal/chat.py; probed once)."""
        if self._template_takes_parts is None:
            self._template_takes_parts = template_takes_parts(
                lambda m: apply_chat_template(self.tokenizer, m, True, self.chat_template, tokenize=False)
            )
        return self._template_takes_parts

    def renders_tools(self) -> bool:
        """Whether the chat template uses its `tools` variable (a probe rendered with and without)."""
        if self._template_renders_tools is None:
            probe = [{"role": "user", "content": "hi"}]
            tool = {"type": "function", "function": {"name": "probe_tool_xyz", "parameters": {"type": "object"}}}
            try:
                self._template_renders_tools = apply_chat_template(
                    self.tokenizer, probe, True, self.chat_template, tools=[tool]
                ) != apply_chat_template(self.tokenizer, probe, True, self.chat_template)
            except Exception:
                self._template_renders_tools = False
        return self._template_renders_tools

    def tool_plan(
        self, req: ChatCompletionRequest
    ) -> tuple[Optional[list[dict]], Optional[ToolParser], Optional[StructuredOutputsParams]]:
        """(tools for the prompt, the parser of the output, the constraint that enforces the
        choice) for the request's tools and tool_choice; 400 when they cannot be honoured."""
        tools = [t.function.model_dump(exclude_none=True) for t in req.tools or []]
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
        if choice == "none":
            return None, None, None
        if not tools:
            raise OpenAIError(f"tool_choice {choice!r} needs tools", param="tool_choice")
        if choice == "auto":
            if not (self.enable_auto_tool_choice and self.tool_parser_class):
                raise OpenAIError(
                    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                    param="tool_choice",
                )
            return tools, self.tool_parser_class(tools), None
        if choice == "required":
            schema = required_schema(tools, req.parallel_tool_calls)
            parser = RequiredToolParser()
        else:
            named = [t for t in tools if t["name"] == choice.function.name]
            if not named:
                raise OpenAIError(
                    f"tool_choice names the function {choice.function.name!r}, which is not in tools",
                    param="tool_choice",
                )
            schema = named[0].get("parameters") or {"type": "object"}
            parser = NamedToolParser(named[0]["name"])
        from pagedllm.structured_output.backend_xgrammar import validate_structured_outputs

        try:
            constraint = StructuredOutputsParams(json=schema)
            validate_structured_outputs(constraint, "tools")
        except ValueError as e:
            raise OpenAIError(str(e), param="tools") from None
        return tools, parser, constraint

    async def create_chat_completion(self, req: ChatCompletionRequest, raw_request=None):
        self.check_model(req.model)
        self.check_stream_fields(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if max_tokens is not None and max_tokens < 1:
            raise OpenAIError(f"{param} must be an integer >= 1, got {max_tokens}", param=param)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if req.use_beam_search:
            self.check_beam_search(req)
        tools, tool_parser, tool_constraint = self.tool_plan(req)
        if tools and req.use_beam_search:
            raise OpenAIError("tools are not supported with use_beam_search", param="tools")
        with bad_input_is_400(_RENAMES):
            params = req.sampling_params(
                max_tokens=max_tokens,
                logprobs=logprobs,
                prompt_logprobs=req.prompt_logprobs,
                defaults=self.sampling_defaults,
            )  # the values, first
        if tool_constraint is not None and params.structured_outputs is not None:
            raise OpenAIError(
                "tool_choice required or a named function constrains the output already: "
                "response_format / structured_outputs cannot be added",
                param="tool_choice",
            )
        conv = self.conversation(req.messages, images=True)
        prompt = None
        if has_image_parts(conv):
            prompt = await self.image_prompt(conv, req, tools)
            ids = prompt.token_ids
        else:
            ids = self.prompt_ids(
                conv, req.add_generation_prompt, req.continue_final_message, tools, req.chat_template_kwargs
            )
        if not ids:
            raise OpenAIError("the messages produced an empty prompt", param="messages")
        max_tokens = self.check_context(len(ids), max_tokens, "messages")
        with bad_input_is_400(_RENAMES):
            params = req.sampling_params(
                max_tokens=max_tokens,
                logprobs=logprobs,
                prompt_logprobs=req.prompt_logprobs,
                defaults=self.sampling_defaults,
            )
        if tool_constraint is not None:
            params.structured_outputs = tool_constraint
        if tool_parser is not None and tool_parser.keeps_special_tokens:  # its marker is a special token
            params.skip_special_tokens = False
        request_id = random_id("chatcmpl")
        created = int(time.time())
        if req.use_beam_search:
            if prompt is not None:
                raise OpenAIError("images are not supported with use_beam_search", param="use_beam_search")
            handles = self.start_beam_searches(req, [(ids, max_tokens)], request_id)
            if req.stream:
                return self._beam_stream(req, request_id, created, handles, len(ids))
            return await self._beam_full(req, request_id, created, handles, len(ids))
        kind = OutputKind.DELTA if req.stream else OutputKind.FINAL_ONLY
        stream = self.engine.add_request(
            prompt or {"prompt_token_ids": ids},
            params,
            request_id,
            kind,
            lora_request=self.lora_request(req.model),
            priority=req.priority,
        )

        reasoning_parser = self.reasoning_parser_class() if self.reasoning_parser_class else None

        def output_parser() -> ChatOutputParser:  # one per choice (the parsers themselves keep no state)
            return ChatOutputParser(reasoning_parser, tool_parser)

        if req.stream:
            return self._stream(req, request_id, created, stream, len(ids), output_parser)
        return await self._full(req, request_id, created, stream, len(ids), output_parser)

    async def image_prompt(self, conv: list[dict], req: ChatCompletionRequest, tools) -> ProcessedPrompt:
        """A conversation with image_url parts -> its text with one placeholder per image, expanded
        by the model's processor. 400 naming the part for a text-only model, more images than
        --limit-mm-per-prompt, or an image that does not load, before any image is fetched (the
        count) or processed (the loading); the loading and the processor run in a thread."""
        processor = self.engine.processor
        where = image_part_locations(conv)
        as_parts = self.template_takes_parts()
        if tools and as_parts and not self.renders_tools():
            raise OpenAIError(
                "tools with images need a chat template that renders tools: this one takes "
                "content parts, and the tools' system block is text",
                param="tools",
            )
        with bad_input_is_400():
            mm = processor.load_mm_processor(where[0])
            processor.check_image_count(len(where), "messages")
            messages, images = await asyncio.to_thread(
                split_image_parts,
                conv,
                chat_placeholder(mm),
                processor.config.model_config.allowed_local_media_path,
                as_parts,
            )
            processor.check_messages_chars(messages)
        text = self.prompt_ids(
            messages,
            req.add_generation_prompt,
            req.continue_final_message,
            tools,
            req.chat_template_kwargs,
            tokenize=False,
        )
        try:  # the processor's errors (a placeholder typed into the text, a split image) name no field
            return await asyncio.to_thread(
                processor.process_images, {"prompt": text, "multi_modal_data": {"image": images}}
            )
        except ValueError as e:
            raise OpenAIError(str(e), param=getattr(e, "param", None) or "messages") from None

    # ------------------------------------------------------------ logprobs
    def _logprobs(self, token_ids, logprobs, k: int) -> ChatChoiceLogprobs:
        content = []
        for pos in logprobs:
            (sid, slp), top = self.sampled_and_top(pos, k)
            tok = self.token_str(sid, slp)
            content.append(
                ChatLogprobContent(
                    token=tok,
                    logprob=max(slp.logprob, -9999.0),
                    bytes=self.token_bytes(sid, tok),
                    top_logprobs=[
                        ChatLogprob(
                            token=self.token_str(t, lp),
                            logprob=max(lp.logprob, -9999.0),
                            bytes=self.token_bytes(t, self.token_str(t, lp)),
                        )
                        for t, lp in top
                    ],
                )
            )
        return ChatChoiceLogprobs(content=content)

    # ------------------------------------------------------------ non-streaming
    async def _full(self, req, request_id, created, stream, num_prompt, output_parser) -> ChatCompletionResponse:
        final = None
        async for _, out in self.merge([stream]):
            final = out
        choices, num_gen = [], 0
        for c in final.outputs:
            lp = None
            if req.logprobs and c.logprobs is not None:
                lp = self._logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0)
            reasoning, content, calls = output_parser().final(c.text, truncated=c.finish_reason == "length")
            message = ChatResponseMessage(content=content, reasoning_content=reasoning, tool_calls=calls)
            choices.append(
                ChatCompletionChoice(
                    index=c.index,
                    message=message,
                    logprobs=lp,
                    finish_reason=_finish_reason(c.finish_reason, bool(calls)),
                    stop_reason=c.stop_reason,
                )
            )
            num_gen += len(c.token_ids)
        choices.sort(key=lambda ch: ch.index)
        return ChatCompletionResponse(
            id=request_id,
            created=created,
            model=self.model_name,
            choices=choices,
            usage=UsageInfo(
                prompt_tokens=num_prompt,
                completion_tokens=num_gen,
                total_tokens=num_prompt + num_gen,
                prompt_tokens_details=PromptTokensDetails(cached_tokens=final.num_cached_tokens),
            ),
            prompt_logprobs=prompt_logprobs_json(final.prompt_logprobs),
            kv_transfer_params=final.kv_transfer_params,
        )

    # ------------------------------------------------------------ beam search
    async def _beam_full(self, req, request_id, created, handles, num_prompt) -> ChatCompletionResponse:
        (res,) = await self.beam_results(handles)
        choices = [
            ChatCompletionChoice(
                index=j,
                message=ChatResponseMessage(content=h.text),
                logprobs=self._logprobs(h.tokens, self.beam_logprobs(h), 0) if req.logprobs else None,
                finish_reason=h.finish_reason,
            )
            for j, h in enumerate(res.sequences)
        ]
        num_gen = sum(len(h.tokens) for h in res.sequences)
        return ChatCompletionResponse(
            id=request_id,
            created=created,
            model=self.model_name,
            choices=choices,
            usage=UsageInfo(
                prompt_tokens=num_prompt,
                completion_tokens=num_gen,
                total_tokens=num_prompt + num_gen,
                prompt_tokens_details=PromptTokensDetails(cached_tokens=res.num_cached_tokens),
            ),
        )

    def _beam_stream(self, req, request_id, created, handles, num_prompt) -> AsyncIterator[str]:
        """Beam search has no partial output: each final choice in one chunk (role, content and
        finish reason), then [DONE]."""
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
        return stream_final(
            lambda: self._beam_full(req, request_id, created, handles, num_prompt),
            head,
            lambda c: {
                "index": c.index,
                "delta": {"role": "assistant", "content": c.message.content},
                "logprobs": c.logprobs.model_dump() if c.logprobs else None,
                "finish_reason": c.finish_reason,
            },
            bool(req.stream_options and req.stream_options.include_usage),
        )

    # ------------------------------------------------------------ streaming
    async def _stream(self, req, request_id, created, stream, num_prompt, output_parser) -> AsyncIterator[str]:
        n = req.n or 1
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(include_usage and req.stream_options.continuous_usage_stats)
        num_gen = 0

        def chunk(choices, usage=None):
            c = {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
                "choices": choices,
            }
            if include_usage:
                c["usage"] = usage
            return sse(c)

        merged = self.merge([stream])
        try:
            # The role first, for every choice (as OpenAI does).
            for i in range(n):
                yield chunk(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    usage_dict(num_prompt, 0) if continuous else None,
                )
            cached = 0
            parsers = [output_parser() for _ in range(n)]
            async for _, out in merged:
                cached = out.num_cached_tokens
                for c in out.outputs:
                    num_gen += len(c.token_ids)
                    lp = None
                    if req.logprobs and c.logprobs:
                        lp = self._logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0).model_dump()
                    parser = parsers[c.index]
                    delta = parser.delta(c.text, c.finish_reason is not None, c.finish_reason == "length")
                    if not delta and lp is None and c.finish_reason is None:
                        continue
                    yield chunk(
                        [
                            {
                                "index": c.index,
                                "delta": delta,
                                "logprobs": lp,
                                "finish_reason": _finish_reason(c.finish_reason, parser.called_tools),
                                "stop_reason": c.stop_reason,
                            }
                        ],
                        usage_dict(num_prompt, num_gen) if continuous else None,
                    )
            if include_usage:
                yield chunk([], usage_dict(num_prompt, num_gen, cached))
        except Exception as e:  # the engine died or the server is stopping
            yield sse(stream_error(e).body())
        finally:
            await merged.aclose()
        yield SSE_DONE
