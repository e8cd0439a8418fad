"""Reasoning parsers by name (`--reasoning-parser NAME`): split `<think>...</think>` off the answer
into `reasoning_content`."""

from __future__ import annotations

from typing import Optional

from pagedllm.entrypoints.openai.tool_parsers.abstract import held_back

THINK, END_THINK = "<think>", "</think>"


class DeepSeekR1ReasoningParser:
    """DeepSeek-R1: the model thinks first (its template may already have written `<think>`);
    everything up to `</think>` is reasoning, even when `</think>` never comes."""

    think_without_tag = True

    def extract(self, text: str, partial: bool) -> tuple[Optional[str], str]:
        """(reasoning, content) of the whole output so far; while `partial`, a tail that may
        begin a tag is held back."""
        body = text[len(THINK) :] if text.startswith(THINK) else text
        if not text.startswith(THINK) and not self.think_without_tag:
            if partial and THINK.startswith(text):
                return None, ""
            return None, text
        reasoning, sep, content = body.partition(END_THINK)
        if not sep and partial:
            reasoning = reasoning[: len(reasoning) - held_back(reasoning, END_THINK)]
        return reasoning, content.lstrip("\n") if sep else ""


class Qwen3ReasoningParser(DeepSeekR1ReasoningParser):
    """Qwen3: thinking is optional (enable_thinking=False in chat_template_kwargs turns it off):
    text that does not start with `<think>` is all answer."""

    think_without_tag = False


REASONING_PARSERS = {"deepseek_r1": DeepSeekR1ReasoningParser, "qwen3": Qwen3ReasoningParser}
