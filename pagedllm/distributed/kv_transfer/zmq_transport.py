"""The bytes of a request's KV blocks between two instances, over ZMQ.

The producer (`KVServer`, a thread next to the KV cache) serves pulls on a ROUTER socket:
a consumer sends `pull {req_id, first_block, shm}` and gets one message per layer, in layer
order, each sent as soon as that layer's K/V of the request is written (`layer_done`, called
from the prefill's forward): the transfer overlaps the prefill's later layers. A layer's
message is a JSON header and the layer's tensors (K, V; MLA: the latent) over the request's
blocks from `first_block` on. Same host and `shm`: the tensors go through one shared-memory
segment per pull instead (the header names it and the offsets), and the consumer's `done`
lets the producer unlink it. The consumer (`pull_kv`) writes each layer into its own blocks
as it arrives and gives up after `timeout_s` of silence (a dead or stopped producer).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from multiprocessing import resource_tracker, shared_memory
from typing import Optional

import torch
import zmq

logger = logging.getLogger(__name__)


def block_rows(block_ids: list[int], block_size: int, device) -> torch.Tensor:
    """Cache rows of the blocks, in order: [len(block_ids) * block_size] int64."""
    ids = torch.tensor(block_ids, dtype=torch.int64)
    return (ids[:, None] * block_size + torch.arange(block_size)).reshape(-1).to(device)


def layer_bytes(layer: tuple[torch.Tensor, ...], rows: torch.Tensor) -> list[torch.Tensor]:
    """The layer's tensors over `rows`, each as contiguous host bytes [n_bytes] uint8."""
    return [t[rows].cpu().contiguous().view(-1).view(torch.uint8) for t in layer]


@dataclass
class _Saved:
    """A request whose blocks the producer serves until they are fetched or time out."""

    block_ids: list[int]
    deadline: float
    layers_ready: int = 0
    pulls: list = field(default_factory=list)  # _Pull


@dataclass
class _Pull:
    identity: bytes
    req_id: str
    first_block: int
    shm: Optional[shared_memory.SharedMemory] = None
    offset: int = 0
    next_layer: int = 0


class KVServer:
    """The producer's side: a thread that owns the ROUTER socket (ZMQ sockets are not thread
    safe); the runner's thread only updates `_saved` under the lock."""

    def __init__(
        self, host: str, port: int, kv_caches: list[tuple[torch.Tensor, ...]], block_size: int, timeout_s: float
    ) -> None:
        self.kv_caches, self.block_size, self.timeout_s = kv_caches, block_size, timeout_s
        self.lock = threading.Lock()
        self._saved: dict[str, _Saved] = {}
        self._pulling: set[str] = set()  # saved requests with a pull under way: the loop's work
        self._next_expiry = 0.0
        self._finished: set[str] = set()
        self.bytes_sent = 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"tcp://{host}:{port}")
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kv-server", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the runner's thread
    def expect(self, reqs: dict[str, list[int]]) -> None:
        """Requests whose prefill completes in the step about to run: served as it goes."""
        deadline = time.monotonic() + self.timeout_s
        with self.lock:
            for req_id, block_ids in reqs.items():
                self._saved[req_id] = _Saved(list(block_ids), deadline)

    def layer_done(self, layer_index: int, req_ids) -> None:
        with self.lock:
            for req_id in req_ids:
                s = self._saved.get(req_id)
                if s is not None:
                    s.layers_ready = max(s.layers_ready, layer_index + 1)

    def take_finished(self) -> set[str]:
        with self.lock:
            out, self._finished = self._finished, set()
        return out

    def shutdown(self) -> None:
        self._stop = True
        self._thread.join(timeout=2)
        self._sock.close(0)
        self._ctx.term()

    # ------------------------------------------------------------ the server thread
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop:
            if poller.poll(1):
                while True:  # every message waiting, not one a turn
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_message(frames)
            try:
                self._serve_ready()
            except Exception:  # never let the thread die: the engine would hold blocks forever
                logger.exception("kv server: serving a pull failed")

    def _on_message(self, frames: list[bytes]) -> None:
        identity, kind, body = frames[0], frames[1], json.loads(frames[2])
        req_id = body.get("req_id")
        with self.lock:
            saved = self._saved.get(req_id)
            if kind == b"done":  # a shared-memory pull was copied: unlink, free the blocks
                if saved is not None:
                    self._end(req_id, saved)
                return
            if saved is None:
                self._sock.send_multipart(
                    [
                        identity,
                        json.dumps(
                            {
                                "error": f"request {req_id!r} holds no KV here (fetched already, timed out, "
                                "or never prefilled with do_remote_decode)"
                            }
                        ).encode(),
                    ]
                )
                return
            pull = _Pull(identity, req_id, int(body.get("first_block", 0)))
            if body.get("shm"):
                n = len(saved.block_ids) - pull.first_block
                size = sum(
                    t[0].numel() * t.element_size() * self.block_size * n for layer in self.kv_caches for t in layer
                )
                pull.shm = shared_memory.SharedMemory(create=True, size=max(size, 1))
            saved.pulls.append(pull)
            self._pulling.add(req_id)

    def _serve_ready(self) -> None:
        """Each turn (<= 1 ms apart) visits the requests being pulled; the expiry walk over every
        saved request runs ten times a second (the turn's cost stays with the pulls, not with all
        the KV waiting to be fetched)."""
        now = time.monotonic()
        with self.lock:
            for req_id in list(self._pulling):
                saved = self._saved.get(req_id)
                for pull in list(saved.pulls) if saved is not None else ():
                    self._send_layers(saved, pull)
                if saved is None or not saved.pulls:
                    self._pulling.discard(req_id)
            if now >= self._next_expiry:
                self._next_expiry = now + 0.1
                for req_id, saved in list(self._saved.items()):
                    if now > saved.deadline:
                        logger.warning(
                            "kv server: request %s's KV was not fetched within %.0f s: freeing it",
                            req_id,
                            self.timeout_s,
                        )
                        self._end(req_id, saved)

    def _send_layers(self, saved: _Saved, pull: _Pull) -> None:
        rows = None
        while pull.next_layer < saved.layers_ready:
            if rows is None:
                rows = block_rows(saved.block_ids[pull.first_block :], self.block_size, self.kv_caches[0][0].device)
            layer = self.kv_caches[pull.next_layer]
            parts = layer_bytes(layer, rows)
            header = {
                "layer": pull.next_layer,
                "num_layers": len(self.kv_caches),
                "nbytes": [p.numel() for p in parts],
                "dtype": str(layer[0].dtype),
            }
            if pull.shm is not None:
                header["shm"], header["offset"], header["pid"] = pull.shm.name, pull.offset, os.getpid()
                for p in parts:
                    pull.shm.buf[pull.offset : pull.offset + p.numel()] = p.numpy().data
                    pull.offset += p.numel()
                self._sock.send_multipart([pull.identity, json.dumps(header).encode()])
            else:
                self._sock.send_multipart(
                    [pull.identity, json.dumps(header).encode()] + [p.numpy().data for p in parts], copy=True
                )
            self.bytes_sent += sum(p.numel() for p in parts)
            pull.next_layer += 1
        if pull.next_layer == len(self.kv_caches) and pull.shm is None:
            # Every byte is in ZMQ's buffers: the blocks may go.
            self._end(pull.req_id, saved)

    def _end(self, req_id: str, saved: _Saved) -> None:
        for pull in saved.pulls:
            if pull.shm is not None:
                pull.shm.close()
                pull.shm.unlink()
        saved.pulls.clear()
        if self._saved.pop(req_id, None) is not None:
            self._finished.add(req_id)


def pull_kv(
    ctx: zmq.Context,
    host: str,
    port: int,
    req_id: str,
    first_block: int,
    local_block_ids: list[int],
    kv_caches: list[tuple[torch.Tensor, ...]],
    block_size: int,
    timeout_s: float,
    use_shm: bool,
) -> int:
    """Fetch `req_id`'s blocks from `first_block` on into `local_block_ids`, layer by layer ->
    bytes received. RuntimeError when the producer refuses, sends what does not fit this
    cache, or stays silent for timeout_s."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{host}:{port}")
    rows = block_rows(local_block_ids, block_size, kv_caches[0][0].device)
    shm, total = None, 0
    try:
        sock.send_multipart(
            [b"pull", json.dumps({"req_id": req_id, "first_block": first_block, "shm": use_shm}).encode()]
        )
        for expected in range(len(kv_caches)):
            if not sock.poll(int(timeout_s * 1000)):
                raise RuntimeError(
                    f"KV transfer of {req_id} from {host}:{port}: no answer within "
                    f"{timeout_s:g} s (layer {expected} of {len(kv_caches)})"
                )
            frames = sock.recv_multipart()
            header = json.loads(frames[0])
            if "error" in header:
                raise RuntimeError(f"KV transfer of {req_id} from {host}:{port}: {header['error']}")
            layer = kv_caches[expected]
            want = [rows.numel() * t[0].numel() * t.element_size() for t in layer]
            if header["layer"] != expected or header["num_layers"] != len(kv_caches) or header["nbytes"] != want:
                raise RuntimeError(
                    f"KV transfer of {req_id} from {host}:{port}: the producer's cache does not "
                    f"match this one (layer {header['layer']}/{header['num_layers']}, "
                    f"{header['nbytes']} bytes, expected {expected}/{len(kv_caches)}, {want})"
                )
            if "shm" in header and shm is None:
                shm = shared_memory.SharedMemory(name=header["shm"])
                if header["pid"] != os.getpid():  # the producer unlinks it (one tracker per process)
                    resource_tracker.unregister(shm._name, "shared_memory")
            off = header.get("offset", 0)
            for i, (t, n) in enumerate(zip(layer, want)):
                if shm is not None:
                    src, off = shm.buf[off : off + n], off + n
                else:
                    src = frames[1 + i]
                with warnings.catch_warnings():  # read-only buffer: only read from
                    warnings.simplefilter("ignore")
                    data = torch.frombuffer(src, dtype=torch.uint8)
                t[rows] = data.view(t.dtype).view(-1, *t.shape[1:]).to(t.device)
                total += n
            del src, data
        if shm is not None:
            sock.send_multipart([b"done", json.dumps({"req_id": req_id}).encode()])
            sock.poll(0)
        return total
    finally:
        if shm is not None:
            shm.close()
        sock.close(linger=500 if shm is not None else 0)
