"""ZmqConnector: prefill/decode disaggregation over zmq_transport (vLLM's NixlConnector flow).

Producer (kv_producer / kv_both): a request sent with kv_transfer_params
`{"do_remote_decode": true}` (the proxy's prefill, max_tokens 1) is served layer by layer from
the step that completes its prompt; when it finishes, its blocks are held (delay_free) and its
output carries kv_transfer_params `{"do_remote_prefill": true, "remote_host", "remote_port",
"remote_request_id", "remote_block_ids", "remote_hostname"}`. The blocks go back once fetched,
or after timeout_s.
Consumer (kv_consumer / kv_both): a request carrying those params takes its local prefix-cache
hits, allocates blocks for the rest of the prompt and waits (WAITING_FOR_REMOTE_KVS) while a
worker thread pulls the remote blocks into them; then it computes only its last prompt token
(as vLLM: the logits to sample from) and decodes on.
"""

from __future__ import annotations

import logging
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

from pagedllm.distributed.kv_transfer.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)
from pagedllm.distributed.kv_transfer.config import KVTransferConfig
from pagedllm.request import RequestStatus

logger = logging.getLogger(__name__)

# Pulls in flight at once: each mostly waits on the producer, so a burst of arrivals waited for a
# thread (4: p99 0.38-0.40 s from the step that starts a load to its pull, at 2x overload on 2
# cores; 16: 0.14 s, and the decode engine core's arrival -> first token p99 0.45-0.51 -> 0.35 s).
MAX_CONCURRENT_PULLS = 16


@dataclass
class LoadSpec:
    host: str
    port: int
    remote_request_id: str
    first_block: int  # the remote blocks from here on (the local hits cover the rest)
    local_block_ids: list[int]
    use_shm: bool


class ZmqConnector(KVConnectorBase):
    def __init__(self, config: KVTransferConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        self.hostname = socket.gethostname()
        # scheduler side
        self._loads: dict[str, LoadSpec] = {}
        # worker side
        self.server = None
        self._saving: list[str] = []  # this step's requests served as their layers finish
        self._lock = threading.Lock()
        self._recved: set[str] = set()
        self._failed: dict[str, str] = {}
        self._bytes_recved = 0
        self._pool: Optional[ThreadPoolExecutor] = None

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not (self.config.is_consumer and params and params.get("do_remote_prefill")):
            return 0, False
        if request.sampling_params.num_samples > 1 or request.group_id is not None:
            return 0, False  # siblings and beams compute their prompt here
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        params["do_remote_prefill"] = False  # once: a preempted request recomputes locally
        if num_external_tokens <= 0:
            return
        first = (request.num_prompt_tokens - num_external_tokens) // self._block_size
        remote = params["remote_block_ids"]
        same_host = params.get("remote_hostname") == self.hostname and self.config.use_shm
        self._loads[request.request_id] = LoadSpec(
            params["remote_host"],
            params["remote_port"],
            params["remote_request_id"],
            first,
            block_ids[first : len(remote)],
            same_host,
        )

    def bind_block_size(self, block_size: int) -> None:
        self._block_size = block_size

    def build_connector_meta(
        self, scheduler_output, requests: dict, get_block_ids: Callable[[str], list[int]]
    ) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(reqs_to_load=self._loads)
        self._loads = {}
        if self.config.is_producer:
            for req_id, n in scheduler_output.num_scheduled_tokens.items():
                r = requests[req_id]
                params = r.kv_transfer_params
                # num_computed_tokens is from before this step: the step completes the prompt.
                if (
                    params
                    and params.get("do_remote_decode")
                    and r.num_computed_tokens < r.num_prompt_tokens <= r.num_computed_tokens + n
                ):
                    meta.reqs_to_save[req_id] = get_block_ids(req_id)
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        params = request.kv_transfer_params
        if not (self.config.is_producer and params and params.get("do_remote_decode")):
            return False, None
        if request.status == RequestStatus.FINISHED_ABORTED or request.num_computed_tokens < request.num_prompt_tokens:
            return False, None  # never served: nothing to hold
        n = -(request.num_prompt_tokens // -self._block_size)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_host": self.config.kv_ip,
            "remote_port": self.config.kv_port,
            "remote_hostname": self.hostname,
            "remote_request_id": request.request_id,
            "remote_block_ids": block_ids[:n],
        }

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: list[tuple], block_size: int) -> None:
        from pagedllm.distributed.kv_transfer.zmq_transport import KVServer
        import zmq

        self.kv_caches, self._block_size = kv_caches, block_size
        self._ctx = zmq.Context()
        if self.config.is_producer:
            self.server = KVServer(self.config.kv_ip, self.config.kv_port, kv_caches, block_size, self.config.timeout_s)
        if self.config.is_consumer:
            self._pool = ThreadPoolExecutor(MAX_CONCURRENT_PULLS, thread_name_prefix="kv-pull")

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Start this step's pulls on the pool (they run across steps) and register its saves."""
        for req_id, spec in metadata.reqs_to_load.items():
            self._pool.submit(self._load, req_id, spec)
        self._saving = list(metadata.reqs_to_save)
        if self._saving:
            self.server.expect(metadata.reqs_to_save)

    def _load(self, req_id: str, spec: LoadSpec) -> None:
        from pagedllm.distributed.kv_transfer.zmq_transport import pull_kv

        try:
            n = pull_kv(
                self._ctx,
                spec.host,
                spec.port,
                spec.remote_request_id,
                spec.first_block,
                spec.local_block_ids,
                self.kv_caches,
                self._block_size,
                self.config.timeout_s,
                spec.use_shm,
            )
        except Exception as e:
            logger.warning("KV load of %s failed: %s", req_id, e)
            with self._lock:
                self._failed[req_id] = str(e)
            return
        with self._lock:
            self._recved.add(req_id)
            self._bytes_recved += n

    def wait_for_layer_load(self, layer_index: int) -> None:
        """Nothing to wait for: a request runs only once all of its layers are in."""

    def save_kv_layer(self, layer_index: int) -> None:
        if self._saving:
            self.server.layer_done(layer_index, self._saving)

    def wait_for_save(self) -> None:
        """Every layer is written (also where no per-layer hook ran: the C++ decode loop, a
        CUDA graph)."""
        if self._saving:
            self.server.layer_done(len(self.kv_caches) - 1, self._saving)
            self._saving = []

    def get_finished(self) -> KVConnectorOutput:
        out = KVConnectorOutput()
        if self.server is not None:
            out.finished_sending = self.server.take_finished()
            out.bytes_sent, self.server.bytes_sent = self.server.bytes_sent, 0
        with self._lock:
            out.finished_recving, self._recved = self._recved, set()
            out.failed_recving, self._failed = self._failed, {}
            out.bytes_recved, self._bytes_recved = self._bytes_recved, 0
        return out

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.shutdown()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
