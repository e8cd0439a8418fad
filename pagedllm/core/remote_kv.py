"""RemoteKV: the scheduler's bookkeeping around a KV connector (distributed/kv_transfer).

A consumer's request with remote KV takes its local prefix hits, gets blocks for the rest of
its prompt and waits in WAITING_FOR_REMOTE_KVS (in the waiting queue, passed over, holding its
blocks) until the worker reports the load done; then it is admitted to compute its last prompt
token. A producer's finished request keeps its blocks (`sending`) until the worker reports them
fetched or timed out. No block a load writes into is findable in the prefix cache before the
load is done, and none is freed while a load may still write into it (an abort waits for it).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.request import Request, RequestStatus


@contextmanager
def _no_caching(kv: KVCacheManager):
    """Blocks allocated inside are not hashed: their KV is not there yet. The request's next
    allocation (after the load) hashes them, as it does every full block without a hash."""
    was, kv.enable_caching = kv.enable_caching, False
    try:
        yield
    finally:
        kv.enable_caching = was


class RemoteKV:
    def __init__(self, connector, kv: KVCacheManager) -> None:
        self.connector, self.kv = connector, kv
        self.loading: set[str] = set()  # loads in flight
        self.loaded: set[str] = set()  # done, not admitted yet
        self.sending: dict[str, Request] = {}  # finished producer requests holding blocks
        self.aborted_loading: dict[str, Request] = {}  # ended while a load may still write
        self.bytes_sent = 0
        self.bytes_recved = 0

    def has_work(self) -> bool:
        return bool(self.sending or self.aborted_loading)

    def check_waiting(self, request: Request) -> Optional[bool]:
        """The waiting request at the front: True while its KV loads (it keeps its place,
        passed over); False: admit it as usual; None: no blocks for its load now."""
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            if request.request_id not in self.loaded:
                return True
            self.loaded.discard(request.request_id)
            # Every prompt token is in; the last is computed again for its logits (as vLLM).
            request.num_computed_tokens = request.num_prompt_tokens - 1
            request.status = RequestStatus.WAITING
            return False
        if request.num_computed_tokens or self.kv.is_swapped(request):
            return False
        hits, num_hits = self.kv.get_computed_blocks(request)
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_hits)
        if num_external <= 0 or not load_async:
            return False
        with _no_caching(self.kv):
            if self.kv.allocate_slots(request, num_external, hits) is None:
                return None
        request.num_computed_tokens = num_hits
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hits
            self.kv.stats.queries += request.num_tokens
            self.kv.stats.hits += num_hits
        self.connector.update_state_after_alloc(request, self.kv.get_block_ids(request.request_id), num_external)
        self.loading.add(request.request_id)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        return True

    def release_loaded(self, waiting, head: Request) -> int:
        """Nothing runs and `head` finds no blocks: the requests behind it whose load is done give
        their blocks back and will compute their prompt here (a load is used once), or blocks held
        by requests that cannot start would wait for each other for ever. Returns how many."""
        released = 0
        for request in waiting:
            if request is not head and request.request_id in self.loaded:
                self.loaded.discard(request.request_id)
                self.kv.free(request)
                request.num_computed_tokens = 0
                request.status = RequestStatus.PREEMPTED
                request.num_preemptions += 1
                released += 1
        return released

    def on_finished(self, request: Request) -> tuple[bool, Optional[dict]]:
        """(the blocks are held: do not free them, the kv_transfer_params for the output)."""
        self.loaded.discard(request.request_id)  # aborted after its load, before admission
        if request.request_id in self.loading:
            self.aborted_loading[request.request_id] = request
            return True, None
        held, params = self.connector.request_finished(request, self.kv.get_block_ids(request.request_id))
        if held:
            self.sending[request.request_id] = request
        return held, params

    def update(self, out) -> list[tuple[str, str]]:
        """A step's KVConnectorOutput -> the requests whose load failed (req id, why), still to end."""
        if out is None:
            return []
        self.bytes_sent += out.bytes_sent
        self.bytes_recved += out.bytes_recved
        for req_id in out.finished_sending:
            request = self.sending.pop(req_id, None)
            if request is not None:
                self.kv.free(request)
        failed = []
        for req_id in list(out.finished_recving) + list(out.failed_recving):
            self.loading.discard(req_id)
            request = self.aborted_loading.pop(req_id, None)
            if request is not None:
                self.kv.free(request)
            elif req_id in out.failed_recving:
                failed.append((req_id, out.failed_recving[req_id]))
            else:
                self.loaded.add(req_id)
        return failed
