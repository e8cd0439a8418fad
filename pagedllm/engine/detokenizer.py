"""Incremental detokenization and stop-string detection, one request at a time.

Two decoders turn a request's tokens into text as they arrive, at a cost per token that does
not grow with the output:
- `_StreamDecoder`, for fast (Rust) tokenizers: the `tokenizers` library's own DecodeStream
  (as vLLM's FastIncrementalDetokenizer), ~5x cheaper a token than the window below.
- `_WindowDecoder`, for the others: vLLM's original method. Keep the token *strings* of the
  sequence and two offsets into them, `prefix_offset` .. `read_offset` (tokens already turned
  into text, kept as context) and `read_offset` .. end (tokens not yet turned into text). Each
  step decodes only that short window and emits what the new tokens add to the context's text.
Both start from a few prompt tokens as context, which keeps the tokenizer's context-dependent
rules (leading spaces of SentencePiece, byte-level pieces) right for the first output token.

A character split over several byte-level tokens decodes to U+FFFD until its last byte
arrives; both decoders emit nothing until then, so the replacement character never reaches a
stream (the bytes are only flushed at the end if they never complete).
"""

from __future__ import annotations

from typing import Optional

from pagedllm.sampling_params import SamplingParams

# Prompt tokens kept as context for the first output token (vLLM uses the same numbers):
# enough for a SentencePiece "▁" or a split multi-byte character before it.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


def detokenize_all(tokenizer, token_ids: list[int], skip_special_tokens: bool = True) -> str:
    """Whole-sequence decode (prompt text, final checks); not for per-step use."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


class _WindowDecoder:
    """Token strings and two offsets (see the module's docstring); any transformers tokenizer."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self._skip_ids = skip_ids
        ctx = self._to_tokens(prompt_token_ids[-(_PROMPT_CONTEXT_TOKENS + 2) :])
        # A prompt ending inside a multi-byte character would make the context's text end in
        # U+FFFD and spoil the subtraction below; start without context then.
        if ctx and tokenizer.convert_tokens_to_string(ctx).endswith(_REPLACEMENT):
            ctx = []
        self.tokens: list[str] = ctx
        self.prefix_offset = max(len(ctx) - _PROMPT_CONTEXT_TOKENS, 0)
        self.read_offset = len(ctx)

    def _to_tokens(self, ids) -> list[str]:
        conv = self.tokenizer.convert_ids_to_tokens
        return [t for t in (conv(int(i)) for i in ids if int(i) not in self._skip_ids) if t is not None]

    def next(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is unfinished)."""
        if token_id in self._skip_ids:
            return ""
        token = self.tokenizer.convert_ids_to_tokens(int(token_id))
        if token is None:
            # An id past the tokenizer's vocabulary (the model's logits can be wider, padded):
            # it has no text, as in vLLM; it must not fail the output loop of every request.
            return ""
        self.tokens.append(token)
        to_string = self.tokenizer.convert_tokens_to_string
        prefix_text = to_string(self.tokens[self.prefix_offset : self.read_offset])
        new_text = to_string(self.tokens[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            # Unfinished multi-byte character (or a token that adds no text yet): wait.
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """The text of tokens held back for a character that never completed."""
        if self.read_offset == len(self.tokens):
            return ""
        to_string = self.tokenizer.convert_tokens_to_string
        prefix_text = to_string(self.tokens[self.prefix_offset : self.read_offset])
        text = to_string(self.tokens[self.prefix_offset :])[len(prefix_text) :]
        self.prefix_offset = self.read_offset = len(self.tokens)
        return text


class _StreamDecoder:
    """tokenizers' DecodeStream over the fast tokenizer's Rust backend. It keeps its own window;
    the ids fed to it are kept here only for the flush of a character that never completes."""

    def __init__(self, backend, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        from tokenizers.decoders import DecodeStream

        self.backend = backend
        self.skip = skip_special_tokens
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        prompt = [int(i) for i in prompt_token_ids if 0 <= int(i) < self.vocab_size]
        # The shortest suffix of 4 or more prompt tokens that decodes without U+FFFD (vLLM's
        # choice): a prompt ending inside a multi-byte character starts on a whole one.
        ctx = []
        for n in range(min(4, len(prompt)), min(len(prompt), 24) + 1):
            if n and _REPLACEMENT not in backend.decode(prompt[-n:], skip_special_tokens=skip_special_tokens):
                ctx = prompt[-n:]
                break
        for tid in ctx:
            self._step(tid)
        self.ids: list[int] = list(ctx)  # every id fed to the stream
        self.emitted = len(ctx)  # ids[:emitted] are text already

    def _step(self, token_id: int) -> Optional[str]:
        try:
            return self.stream.step(self.backend, token_id)
        except Exception as e:  # the stream's state no longer decodes (vLLM resets it the same way)
            if "Invalid prefix encountered" not in str(e):
                raise
            from tokenizers.decoders import DecodeStream

            self.stream = DecodeStream(skip_special_tokens=self.skip)
            return self.stream.step(self.backend, token_id)

    def next(self, token_id: int) -> str:
        if not 0 <= token_id < self.vocab_size:  # past the vocabulary (padded logits): no text
            return ""
        text = self._step(token_id)
        self.ids.append(token_id)
        if not text:
            return ""
        self.emitted = len(self.ids)
        return text

    @property
    def pending(self) -> list[int]:
        """Ids the stream has not turned into text yet (a character still incomplete)."""
        return self.ids[self.emitted :]

    @property
    def context(self) -> list[int]:
        """The last ids already turned into text, the context a flush decodes pending after."""
        return self.ids[max(self.emitted - _PROMPT_CONTEXT_TOKENS, 0) : self.emitted]

    def flush(self) -> str:
        if self.emitted == len(self.ids):
            return ""
        decode, context = self.backend.decode, self.context
        prefix = decode(context, skip_special_tokens=self.skip)
        text = decode(context + self.pending, skip_special_tokens=self.skip)[len(prefix) :]
        self.emitted = len(self.ids)
        return text


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams, fast: bool = True):
        """fast: the DecodeStream decoder where the tokenizer has a Rust backend (False: the
        window decoder, for tests)."""
        self.tokenizer = tokenizer
        self.detokenize = params.detokenize and tokenizer is not None
        self.skip_special_tokens = params.skip_special_tokens
        self.stop: list[str] = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        # While streaming, hold back enough text that a stop string, once it completes,
        # can still be cut off: a stop string's first len-1 chars may already be here.
        # When the stop string stays in the output, nothing needs holding back.
        self.stop_buffer_length = (
            max(map(len, self.stop)) - 1 if self.stop and not self.include_stop_str_in_output else 0
        )
        self.output_text = ""
        self.num_output_tokens = 0
        self._last_output_text_offset = 0
        self._stopped = False  # a stop string ended the text: nothing may be appended
        # New tokens that came after the one completing the stop string (several tokens in one
        # step: a verified speculative run); the output ends at that token, as without drafts.
        self.tokens_after_stop = 0
        self.decoder = None
        if not self.detokenize:
            return
        backend = getattr(tokenizer, "backend_tokenizer", None) if fast else None
        if backend is not None:
            self.decoder = _StreamDecoder(backend, prompt_token_ids, self.skip_special_tokens)
        else:
            # all_special_ids is a property recomputed on each access: look it up once.
            skip_ids = set(tokenizer.all_special_ids) if self.skip_special_tokens else set()
            self.decoder = _WindowDecoder(tokenizer, prompt_token_ids, skip_ids)

    def _flush(self) -> None:
        """At the end, add the text of tokens held back for a character that never completed."""
        if self.decoder is not None:
            self.output_text += self.decoder.flush()

    # ------------------------------------------------------------------ update
    def update(self, new_token_ids: list[int], stop_terminated: bool) -> Optional[str]:
        """Add newly sampled tokens; return the stop string matched, else None.

        On a match, output_text is cut just before the stop string (just after it with
        include_stop_str_in_output). stop_terminated: the last token is EOS / a stop token
        id that already ended the request; as in vLLM its text is left out of the output
        unless include_stop_str_in_output (a skipped special token is left out anyway).
        """
        num_before, num_new = self.num_output_tokens, len(new_token_ids)
        self.num_output_tokens += num_new
        if not self.detokenize or not new_token_ids or self._stopped:
            return None
        if stop_terminated and not self.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]

        stop_check_offset = len(self.output_text)
        text_ends = []  # len(output_text) after each new token
        for i, tid in enumerate(new_token_ids):
            self.output_text += self.decoder.next(int(tid))
            text_ends.append(len(self.output_text))
            # Stop strings count only in the text of output tokens after the first
            # min_tokens (vLLM semantics).
            if num_before + i + 1 <= self.min_tokens:
                stop_check_offset = len(self.output_text)

        if not self.stop or self.num_output_tokens <= self.min_tokens:
            return None
        match = self._check_stop(len(self.output_text) - stop_check_offset)
        if match is None:
            return None
        completing = next((i for i, end in enumerate(text_ends) if end >= match[1]), len(text_ends) - 1)
        self.tokens_after_stop = num_new - 1 - completing
        return match[0]

    def _check_stop(self, new_char_count: int) -> Optional[tuple[str, int]]:
        """(the stop string matched, where its match ends in the text before the cut), else None."""
        if new_char_count <= 0:
            return None
        # Only the new text, plus len(stop)-1 chars before it for a stop string that spans
        # the boundary, can hold a new match: searching more would cost O(output) per step.
        best = None  # (index, stop string); the earliest match wins, then list order
        for s in self.stop:
            start = max(len(self.output_text) - new_char_count - len(s) + 1, 0)
            idx = self.output_text.find(s, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.output_text = self.output_text[: idx + len(s) if self.include_stop_str_in_output else idx]
        self._stopped = True
        return s, idx + len(s)

    # ------------------------------------------------------------------ output
    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The whole text (delta=False) or the text not yet returned (delta=True).

        While not finished, the last stop_buffer_length chars are held back so that a stop
        string is never streamed in part. Once finished, everything is released, including
        bytes of a character that never completed.
        """
        if finished and not self._stopped:
            self._flush()
        buffer_length = 0 if finished else self.stop_buffer_length
        length = max(len(self.output_text) - buffer_length, 0)
        if not delta:
            return self.output_text[:length]
        last = self._last_output_text_offset
        if last >= length:
            return ""
        self._last_output_text_offset = length
        return self.output_text[last:length]
