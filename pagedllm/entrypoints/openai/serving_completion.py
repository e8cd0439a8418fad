"""POST /v1/completions: a prompt (string, list of strings, token ids or lists of them) ->
choices (prompt i, sample j has index i * n + j), streamed or not. With use_beam_search, one
search of width n per prompt: its n best hypotheses are the choices, best first."""

from __future__ import annotations

import time
from typing import AsyncIterator, Optional

from pagedllm.engine.output_processor import OutputKind
from pagedllm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    UsageInfo,
    prompt_logprobs_json,
    usage_dict,
    random_id,
)
from pagedllm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIError,
    OpenAIServing,
    bad_input_is_400,
    sse,
    stream_error,
    stream_final,
)


class OpenAIServingCompletion(OpenAIServing):
    def _prompts(self, req: CompletionRequest) -> list[tuple[Optional[str], list[int]]]:
        """[(text or None, token ids)], validated by the engine's Processor."""
        return self.tokenize_prompts(req.prompt, req.add_special_tokens, "prompt")

    async def create_completion(self, req: CompletionRequest, raw_request=None):
        """A CompletionResponse, or an async iterator of SSE lines (stream=True)."""
        self.check_model(req.model)
        self.check_stream_fields(req)
        if req.suffix:
            raise OpenAIError("suffix is not supported", param="suffix")
        # echo with max_tokens 0: the prompt alone (OpenAI, vLLM); one token is generated and dropped.
        echo_only = req.echo and req.max_tokens == 0
        if req.max_tokens is not None and req.max_tokens < 1 and not echo_only:
            raise OpenAIError(
                f"max_tokens must be an integer >= 1 (or 0 with echo), got {req.max_tokens}", param="max_tokens"
            )
        max_tokens = 1 if echo_only else req.max_tokens
        # echo with logprobs: the prompt's tokens come with their logprobs and top k too.
        prompt_logprobs = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            prompt_logprobs = max(req.logprobs, prompt_logprobs or 0)
        if req.use_beam_search:
            self.check_beam_search(req)
            if echo_only or prompt_logprobs is not None:
                raise OpenAIError(
                    "echo with logprobs or max_tokens 0 is not supported with use_beam_search", param="echo"
                )
        with bad_input_is_400():  # the values, first
            req.sampling_params(
                max_tokens=max_tokens,
                logprobs=req.logprobs,
                prompt_logprobs=prompt_logprobs,
                defaults=self.sampling_defaults,
            )
        prompts = self._prompts(req)
        per_prompt = []
        with bad_input_is_400():
            for text, ids in prompts:
                n_tokens = self.check_context(len(ids), max_tokens, "prompt")
                per_prompt.append(
                    (
                        text,
                        ids,
                        req.sampling_params(
                            max_tokens=n_tokens,
                            logprobs=req.logprobs,
                            prompt_logprobs=prompt_logprobs,
                            defaults=self.sampling_defaults,
                        ),
                    )
                )

        request_id = random_id("cmpl")
        created = int(time.time())
        texts = [t if t is not None else self.tokenizer.decode(ids) for t, ids, _ in per_prompt]
        num_prompt_tokens = sum(len(ids) for _, ids, _ in per_prompt)
        if req.use_beam_search:
            handles = self.start_beam_searches(req, [(ids, p.max_tokens) for _, ids, p in per_prompt], request_id)
            if req.stream:
                return self._beam_stream(req, request_id, created, handles, texts, num_prompt_tokens)
            return await self._beam_full(req, request_id, created, handles, texts, num_prompt_tokens)
        kind = OutputKind.DELTA if req.stream else OutputKind.FINAL_ONLY
        streams = []
        try:
            for i, (_text, ids, params) in enumerate(per_prompt):
                streams.append(
                    self.engine.add_request(
                        {"prompt_token_ids": ids},
                        params,
                        f"{request_id}-{i}",
                        kind,
                        lora_request=self.lora_request(req.model),
                        priority=req.priority,
                    )
                )
        except BaseException:
            for s in streams:
                s.close()
            raise
        echo = _Echo(req, texts, [ids for _, ids, _ in per_prompt], echo_only)
        if req.stream:
            return self._stream(req, request_id, created, streams, echo, num_prompt_tokens)
        return await self._full(req, request_id, created, streams, echo, num_prompt_tokens)

    # ------------------------------------------------------------ logprobs
    def _logprobs(self, token_ids, logprobs, offset: int) -> tuple[CompletionLogprobs, int]:
        """OpenAI's legacy logprobs from offset `offset` of the text; a prompt's first token
        (None: nothing precedes it) has no logprob and no top logprobs."""
        out = CompletionLogprobs()
        for tid, pos in zip(token_ids, logprobs):
            if pos is None:
                tok = self.tokenizer.decode([tid])
                out.tokens.append(tok)
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                (sid, slp), _ = self.sampled_and_top(pos, 0)
                tok = self.token_str(sid, slp)
                out.tokens.append(tok)
                out.token_logprobs.append(max(slp.logprob, -9999.0))
                out.top_logprobs.append({self.token_str(t, lp): max(lp.logprob, -9999.0) for t, lp in pos.items()})
            out.text_offset.append(offset)
            offset += len(tok)
        return out, offset

    # ------------------------------------------------------------ non-streaming
    async def _full(self, req, request_id, created, streams, echo: "_Echo", num_prompt_tokens) -> CompletionResponse:
        n = req.n or 1
        finals: dict[int, object] = {}
        async for i, out in self.merge(streams):
            finals[i] = out
        choices = []
        num_gen = 0
        for i in range(len(streams)):
            for c in finals[i].outputs:
                text, ids, lps, generated = echo.parts(i, c, finals[i].prompt_logprobs, first=True)
                lp = None
                if req.logprobs is not None and lps is not None:
                    lp, _ = self._logprobs(ids, lps, 0)
                choices.append(
                    CompletionChoice(
                        index=i * n + c.index,
                        text=text,
                        logprobs=lp,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        prompt_logprobs=(
                            prompt_logprobs_json(finals[i].prompt_logprobs) if req.prompt_logprobs is not None else None
                        ),
                    )
                )
                num_gen += generated
        choices.sort(key=lambda ch: ch.index)
        cached = sum(f.num_cached_tokens for f in finals.values())
        usage = UsageInfo(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=num_gen,
            total_tokens=num_prompt_tokens + num_gen,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )
        return CompletionResponse(
            id=request_id,
            created=created,
            model=self.model_name,
            choices=choices,
            usage=usage,
            kv_transfer_params=next((f.kv_transfer_params for f in finals.values() if f.kv_transfer_params), None),
        )

    # ------------------------------------------------------------ beam search
    async def _beam_full(self, req, request_id, created, handles, texts, num_prompt_tokens) -> CompletionResponse:
        n = req.n or 1
        results = await self.beam_results(handles)
        choices, num_gen = [], 0
        for i, res in enumerate(results):
            prefix = texts[i] if req.echo else ""
            for j, h in enumerate(res.sequences):
                lp = None
                if req.logprobs is not None:
                    lp, _ = self._logprobs(h.tokens, self.beam_logprobs(h), len(prefix))
                choices.append(
                    CompletionChoice(index=i * n + j, text=prefix + h.text, logprobs=lp, finish_reason=h.finish_reason)
                )
                num_gen += len(h.tokens)
        usage = UsageInfo(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=num_gen,
            total_tokens=num_prompt_tokens + num_gen,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(r.num_cached_tokens for r in results)),
        )
        return CompletionResponse(id=request_id, created=created, model=self.model_name, choices=choices, usage=usage)

    def _beam_stream(self, req, request_id, created, handles, texts, num_prompt_tokens) -> AsyncIterator[str]:
        """Beam search has no partial output: the final choices, one chunk each, then [DONE]."""
        head = {"id": request_id, "object": "text_completion", "created": created, "model": self.model_name}
        return stream_final(
            lambda: self._beam_full(req, request_id, created, handles, texts, num_prompt_tokens),
            head,
            lambda c: c.model_dump(),
            bool(req.stream_options and req.stream_options.include_usage),
        )

    # ------------------------------------------------------------ streaming
    async def _stream(self, req, request_id, created, streams, echo: "_Echo", num_prompt_tokens) -> AsyncIterator[str]:
        """Each choice's first chunk carries the echoed prompt (and its logprobs), as vLLM's."""
        n = req.n or 1
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(include_usage and req.stream_options.continuous_usage_stats)
        started: set[int] = set()
        offsets: dict[int, int] = {}
        num_gen = 0
        cached = [0] * len(streams)
        merged = self.merge(streams)
        try:
            async for i, out in merged:
                cached[i] = out.num_cached_tokens
                for c in out.outputs:
                    idx = i * n + c.index
                    first = idx not in started
                    started.add(idx)
                    text, ids, lps, generated = echo.parts(i, c, out.prompt_logprobs, first)
                    if first:  # an echoed prompt's tokens are at the start of the text too
                        offsets[idx] = 0
                    num_gen += generated
                    lp = None
                    if req.logprobs is not None and lps:
                        lp, offsets[idx] = self._logprobs(ids, lps, offsets[idx])
                    if not text and lp is None and c.finish_reason is None:
                        continue
                    chunk = {
                        "id": request_id,
                        "object": "text_completion",
                        "created": created,
                        "model": self.model_name,
                        "choices": [
                            {
                                "index": idx,
                                "text": text,
                                "logprobs": lp.model_dump() if lp is not None else None,
                                "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason,
                            }
                        ],
                    }
                    if include_usage:
                        chunk["usage"] = usage_dict(num_prompt_tokens, num_gen) if continuous else None
                    yield sse(chunk)
            if include_usage:
                yield sse(
                    {
                        "id": request_id,
                        "object": "text_completion",
                        "created": created,
                        "model": self.model_name,
                        "choices": [],
                        "usage": usage_dict(num_prompt_tokens, num_gen, sum(cached)),
                    }
                )
        except Exception as e:  # the engine died or the server is stopping
            yield sse(stream_error(e).body())
        finally:
            await merged.aclose()
        yield SSE_DONE


class _Echo:
    """What a choice shows of its prompt: with echo, the prompt's text, tokens and (with
    logprobs) logprobs before the completion's; with max_tokens 0, the prompt alone."""

    def __init__(self, req: CompletionRequest, texts: list[str], prompt_ids: list[list[int]], echo_only: bool):
        self.echo, self.with_logprobs, self.echo_only = req.echo, req.logprobs is not None, echo_only
        self.texts, self.prompt_ids = texts, prompt_ids

    def parts(self, i: int, c, prompt_logprobs, first: bool):
        """(text, token ids, logprobs or None, number of generated tokens shown) of prompt i's
        choice c; `first`: its first chunk (the only one that echoes, when streaming)."""
        text, ids, lps = c.text, list(c.token_ids), c.logprobs
        if self.echo_only:
            text, ids, lps = "", [], None
        if not (self.echo and first):
            return text, ids, lps, len(ids)
        generated = len(ids)
        plps = None
        if self.with_logprobs:
            plps = list(prompt_logprobs) + list(lps or [])
        return self.texts[i] + text, self.prompt_ids[i] + ids, plps, generated
