"""A request's structured-output state, as the scheduler sees it (no torch, no xgrammar here):
the compiled grammar arrives through a Future from the manager's thread pool; the matcher is
made from it when the request is first looked at after it is ready."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Optional

from pagedllm.sampling_params import StructuredOutputsParams


class StructuredOutputRequest:
    def __init__(self, params: StructuredOutputsParams) -> None:
        self.params = params
        self.key = (params.kind, params.spec)  # the compiled grammar's cache key
        self.compiled: Optional[Future] = None  # set by StructuredOutputManager.grammar_init
        self.grammar = None  # the matcher (backend's Grammar), once compiled
        self.error: Optional[str] = None  # the compiler's message if compiling failed

    def is_ready(self) -> bool:
        """True once the matcher exists (made here from the finished compilation); a failed
        compilation is ready too, with `error` set."""
        if self.grammar is not None or self.error is not None:
            return True
        if self.compiled is None or not self.compiled.done():
            return False
        try:
            self.grammar = self.compiled.result().new_grammar()
        except Exception as e:  # the compiler's error: the request ends with it
            self.error = f"{type(e).__name__}: {e}"
        return True

    def fork(self) -> "StructuredOutputRequest":
        """A parallel-sampling sibling's state: the same compiled grammar, its own matcher."""
        child = StructuredOutputRequest(self.params)
        child.compiled = self.compiled
        child.is_ready()  # a sibling forked from a running parent starts with its matcher
        return child
