"""Tool parsers by name (`--tool-call-parser NAME`), as vLLM names them."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract import ParsedCall, ParsedOutput, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedllm.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from pagedllm.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from pagedllm.entrypoints.openai.tool_parsers.qwen3_xml import Qwen3XmlToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
    "qwen3_xml": Qwen3XmlToolParser,
}

__all__ = ["TOOL_PARSERS", "ParsedCall", "ParsedOutput", "ToolParser"]
