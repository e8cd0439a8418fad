"""POST /v1/chat/completions: messages through the chat template -> n choices, streamed
(a role delta, then content deltas, then the finish reason) or not. With use_beam_search, the
n best hypotheses of a search of width n, best first."""
from __future__ import annotations

import time
from typing import AsyncIterator

from pagedllm.engine.output_processor import OutputKind
from pagedllm.entrypoints.llm import apply_chat_template
from pagedllm.entrypoints.openai.protocol import (
    ChatChoiceLogprobs, ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse,
    ChatLogprob, ChatLogprobContent, ChatResponseMessage, PromptTokensDetails, UsageInfo, prompt_logprobs_json,
    usage_dict, random_id)
from pagedllm.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIError, OpenAIServing, bad_input_is_400, sse,
                                                      stream_error, stream_final)

_RENAMES = {"logprobs": "top_logprobs"}  # the engine's names -> chat's


class OpenAIServingChat(OpenAIServing):
    def conversation(self, req_messages) -> list[dict]:
        """The messages as the chat template takes them; 400 when their text alone cannot fit
        in the context (checked before the template renders or the tokenizer runs)."""
        conv = []
        for m in req_messages:
            try:
                text = m.text()
            except ValueError as e:
                raise OpenAIError(str(e), param="messages") from None
            msg = {"role": m.role, "content": text if text is not None else ""}
            if m.name is not None:
                msg["name"] = m.name
            conv.append(msg)
        with bad_input_is_400():
            self.engine.processor.check_messages_chars(conv)
        return conv

    def prompt_ids(self, conv: list[dict], add_generation_prompt: bool, continue_final_message: bool) -> list[int]:
        try:
            return apply_chat_template(self.tokenizer, conv, add_generation_prompt, self.chat_template,
                                       continue_final_message)
        except Exception as e:  # ValueError, jinja2 errors (raise_exception in templates), ...
            raise OpenAIError(f"the chat template could not be applied to the messages: {e}",
                              param="messages") from None

    async def create_chat_completion(self, req: ChatCompletionRequest, raw_request=None):
        self.check_model(req.model)
        self.check_stream_fields(req)
        if req.tools:
            raise OpenAIError("tools are not supported", param="tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise OpenAIError("response_format other than text is not supported", param="response_format")
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if max_tokens is not None and max_tokens < 1:
            raise OpenAIError(f"{param} must be an integer >= 1, got {max_tokens}", param=param)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if req.use_beam_search:
            self.check_beam_search(req)
        with bad_input_is_400(_RENAMES):
            req.sampling_params(max_tokens=max_tokens, logprobs=logprobs,
                                prompt_logprobs=req.prompt_logprobs)  # the values, first
        ids = self.prompt_ids(self.conversation(req.messages), req.add_generation_prompt,
                              req.continue_final_message)
        if not ids:
            raise OpenAIError("the messages produced an empty prompt", param="messages")
        max_tokens = self.check_context(len(ids), max_tokens, "messages")
        with bad_input_is_400(_RENAMES):
            params = req.sampling_params(max_tokens=max_tokens, logprobs=logprobs,
                                         prompt_logprobs=req.prompt_logprobs)
        request_id = random_id("chatcmpl")
        created = int(time.time())
        if req.use_beam_search:
            handles = self.start_beam_searches(req, [(ids, max_tokens)], request_id)
            if req.stream:
                return self._beam_stream(req, request_id, created, handles, len(ids))
            return await self._beam_full(req, request_id, created, handles, len(ids))
        kind = OutputKind.DELTA if req.stream else OutputKind.FINAL_ONLY
        stream = self.engine.add_request({"prompt_token_ids": ids}, params, request_id, kind)
        if req.stream:
            return self._stream(req, request_id, created, stream, len(ids))
        return await self._full(req, request_id, created, stream, len(ids))

    # ------------------------------------------------------------ logprobs
    def _logprobs(self, token_ids, logprobs, k: int) -> ChatChoiceLogprobs:
        content = []
        for pos in logprobs:
            (sid, slp), top = self.sampled_and_top(pos, k)
            tok = self.token_str(sid, slp)
            content.append(ChatLogprobContent(
                token=tok, logprob=max(slp.logprob, -9999.0), bytes=self.token_bytes(sid, tok),
                top_logprobs=[ChatLogprob(token=self.token_str(t, lp), logprob=max(lp.logprob, -9999.0),
                                          bytes=self.token_bytes(t, self.token_str(t, lp)))
                              for t, lp in top]))
        return ChatChoiceLogprobs(content=content)

    # ------------------------------------------------------------ non-streaming
    async def _full(self, req, request_id, created, stream, num_prompt) -> ChatCompletionResponse:
        final = None
        async for _, out in self.merge([stream]):
            final = out
        choices, num_gen = [], 0
        for c in final.outputs:
            lp = None
            if req.logprobs and c.logprobs is not None:
                lp = self._logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0)
            choices.append(ChatCompletionChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                                                logprobs=lp, finish_reason=c.finish_reason,
                                                stop_reason=c.stop_reason))
            num_gen += len(c.token_ids)
        choices.sort(key=lambda ch: ch.index)
        return ChatCompletionResponse(id=request_id, created=created, model=self.model_name, choices=choices,
                                      usage=UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_gen,
                                                      total_tokens=num_prompt + num_gen,
                                                      prompt_tokens_details=PromptTokensDetails(
                                                          cached_tokens=final.num_cached_tokens)),
                                      prompt_logprobs=prompt_logprobs_json(final.prompt_logprobs))

    # ------------------------------------------------------------ beam search
    async def _beam_full(self, req, request_id, created, handles, num_prompt) -> ChatCompletionResponse:
        (res,) = await self.beam_results(handles)
        choices = [ChatCompletionChoice(index=j, message=ChatResponseMessage(content=h.text),
                                        logprobs=self._logprobs(h.tokens, self.beam_logprobs(h), 0)
                                        if req.logprobs else None,
                                        finish_reason=h.finish_reason)
                   for j, h in enumerate(res.sequences)]
        num_gen = sum(len(h.tokens) for h in res.sequences)
        return ChatCompletionResponse(id=request_id, created=created, model=self.model_name, choices=choices,
                                      usage=UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_gen,
                                                      total_tokens=num_prompt + num_gen,
                                                      prompt_tokens_details=PromptTokensDetails(
                                                          cached_tokens=res.num_cached_tokens)))

    def _beam_stream(self, req, request_id, created, handles, num_prompt) -> AsyncIterator[str]:
        """Beam search has no partial output: each final choice in one chunk (role, content and
        finish reason), then [DONE]."""
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
        return stream_final(lambda: self._beam_full(req, request_id, created, handles, num_prompt), head,
                            lambda c: {"index": c.index, "delta": {"role": "assistant", "content": c.message.content},
                                       "logprobs": c.logprobs.model_dump() if c.logprobs else None,
                                       "finish_reason": c.finish_reason},
                            bool(req.stream_options and req.stream_options.include_usage))

    # ------------------------------------------------------------ streaming
    async def _stream(self, req, request_id, created, stream, num_prompt) -> AsyncIterator[str]:
        n = req.n or 1
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(include_usage and req.stream_options.continuous_usage_stats)
        num_gen = 0

        def chunk(choices, usage=None):
            c = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                 "model": self.model_name, "choices": choices}
            if include_usage:
                c["usage"] = usage
            return sse(c)

        merged = self.merge([stream])
        try:
            # The role first, for every choice (as OpenAI does).
            for i in range(n):
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}],
                            usage_dict(num_prompt, 0) if continuous else None)
            cached = 0
            async for _, out in merged:
                cached = out.num_cached_tokens
                for c in out.outputs:
                    num_gen += len(c.token_ids)
                    lp = None
                    if req.logprobs and c.logprobs:
                        lp = self._logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0).model_dump()
                    if not c.text and lp is None and c.finish_reason is None:
                        continue
                    delta = {"content": c.text} if c.text or c.finish_reason is None else {}
                    yield chunk([{"index": c.index, "delta": delta, "logprobs": lp,
                                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}],
                                usage_dict(num_prompt, num_gen) if continuous else None)
            if include_usage:
                yield chunk([], usage_dict(num_prompt, num_gen, cached))
        except Exception as e:  # the engine died or the server is stopping
            yield sse(stream_error(e).body())
        finally:
            await merged.aclose()
        yield SSE_DONE

