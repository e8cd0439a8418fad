"""StructuredOutputManager (engine core): compiles each distinct spec once, on a thread pool,
so that a slow schema delays only the requests that use it (they wait in the scheduler,
WAITING_FOR_FSM, until it is ready); each step fills one bitmask row per constrained request
that samples."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

from transformers import AutoTokenizer  # here, not in the pool's thread (an import there can stall)

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.request import Request

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 1024  # distinct specs kept compiled (least recently added dropped first)


class StructuredOutputManager:
    def __init__(self, model_dir: str, vocab_size: int, stop_token_ids: set[int], max_workers: int = 2) -> None:
        self.model_dir, self.vocab_size, self.stop_token_ids = model_dir, vocab_size, stop_token_ids
        self.pool: Optional[ThreadPoolExecutor] = None  # made with the backend on first use
        self._backend: Optional[Future] = None
        self.max_workers = max_workers
        self.cache: dict[tuple[str, str], Future] = {}

    def _make_backend(self):
        from pagedllm.structured_output.backend_xgrammar import XgrammarBackend

        return XgrammarBackend(AutoTokenizer.from_pretrained(self.model_dir), self.vocab_size, self.stop_token_ids)

    def grammar_init(self, request: Request) -> None:
        """Start compiling the request's grammar (or share the one compiled for its spec)."""
        so = request.structured_output_request
        if so is None:
            return
        if self.pool is None:  # the tokenizer's vocabulary is read once, off the loop too
            self.pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="grammar")
            self._backend = self.pool.submit(self._make_backend)
        fut = self.cache.get(so.key)
        if fut is None:
            if len(self.cache) >= MAX_CACHED_GRAMMARS:
                self.cache.pop(next(iter(self.cache)))
            backend = self._backend
            fut = self.cache[so.key] = self.pool.submit(lambda: backend.result().compile(*so.key))
        so.compiled = fut

    def grammar_bitmask(self, requests: dict[str, Request], so: SchedulerOutput) -> None:
        """so.grammar_bitmask [len(so.structured_output_request_ids), ceil(V / 32)] int32 (a
        set bit allows the token), one row per constrained request that samples this step."""
        ids = so.structured_output_request_ids
        if not ids:
            return
        backend = self._backend.result()
        bitmask = backend.allocate_bitmask(len(ids))
        for row, req_id in enumerate(ids):
            requests[req_id].structured_output_request.grammar.fill_bitmask(bitmask, row)
        so.grammar_bitmask = bitmask.numpy()

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
