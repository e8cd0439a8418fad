"""KVConnectorBase: vLLM v1's KV connector interface, in two halves.

The scheduler side (in the engine core, no torch) decides: how many of a waiting request's
tokens exist remotely (`get_num_new_matched_tokens`), what to load once blocks are allocated
(`update_state_after_alloc`), what each step's workers must load and save
(`build_connector_meta`), and whether a finished request's blocks must outlive it
(`request_finished` -> (delay_free, kv_transfer_params)). The worker side (next to the KV
cache) moves the bytes: `start_load_kv` before the forward, `wait_for_layer_load` /
`save_kv_layer` around each attention layer, `wait_for_save` after it, and `get_finished`
reports which transfers ended (their blocks can be freed, or their requests scheduled).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from pagedllm.distributed.kv_transfer.config import KVTransferConfig


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


@dataclass
class KVConnectorMetadata:
    """What one step's workers do: loads {req id: LoadSpec}, saves {req id: block ids}."""

    reqs_to_load: dict[str, Any] = field(default_factory=dict)
    reqs_to_save: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class KVConnectorOutput:
    """What the worker side reports after a step (ModelRunnerOutput.kv_connector_output)."""

    finished_sending: set[str] = field(default_factory=set)  # producer: blocks may be freed
    finished_recving: set[str] = field(default_factory=set)  # consumer: the request may run
    failed_recving: dict[str, str] = field(default_factory=dict)  # consumer: req id -> why
    bytes_sent: int = 0
    bytes_recved: int = 0


class KVConnectorBase:
    def __init__(self, config: KVTransferConfig, role: KVConnectorRole) -> None:
        self.config = config
        self.role = role

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens beyond num_computed_tokens whose KV can be loaded from outside, whether the
        load is asynchronous: the request then waits in WAITING_FOR_REMOTE_KVS)."""
        raise NotImplementedError

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        raise NotImplementedError

    def build_connector_meta(
        self, scheduler_output, requests: dict, get_block_ids: Callable[[str], list[int]]
    ) -> KVConnectorMetadata:
        raise NotImplementedError

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        raise NotImplementedError

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: list[tuple], block_size: int) -> None:
        raise NotImplementedError

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        raise NotImplementedError

    def wait_for_layer_load(self, layer_index: int) -> None:
        raise NotImplementedError

    def save_kv_layer(self, layer_index: int) -> None:
        raise NotImplementedError

    def wait_for_save(self) -> None:
        raise NotImplementedError

    def get_finished(self) -> KVConnectorOutput:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass
