"""Tool parsers by name (`--tool-call-parser NAME`), as vLLM names them."""
from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract import ParsedCall, ParsedOutput, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}

__all__ = ["TOOL_PARSERS", "ParsedCall", "ParsedOutput", "ToolParser"]
