"""The start-up heap kept out of the cyclic garbage collector's way, as vLLM's engine core does.

A server process holds 0.2-0.4 M objects once torch, transformers and the model are loaded (the
engine core ~0.22 M, the API server ~0.39 M), and each collection of the oldest generation walks
all of them (~165 ms on this project's 2-core machine at rest, longer on a shared core), stalling
every request in flight meanwhile. `gc.freeze()` moves the survivors of start-up to the
permanent generation, which no collection walks; what is made later is collected as before.

Only for processes that live until they exit (the engine core process, the API server, the
proxy): a frozen object in a reference cycle is never freed, so the in-process `LLM`, which tests
and notebooks make and drop many times, does not freeze."""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_gc_heap(what: str) -> int:
    """Collect once, then freeze what is left -> the number of objects frozen."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    logger.info(
        "%s: %d start-up objects frozen out of the GC's walks (%.0f ms)", what, n, (time.perf_counter() - t0) * 1e3
    )
    return n
