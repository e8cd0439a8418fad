"""KVTransferConfig: vLLM's `--kv-transfer-config` JSON (kv_connector, kv_role, kv_ip, kv_port,
kv_connector_extra_config), validated here so that a bad value is a ValueError naming the field."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any, Optional

from pagedllm.json_config import fields_from_json

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_CONNECTORS = ("ZmqConnector",)


@dataclass
class KVTransferConfig:
    kv_connector: str = "ZmqConnector"
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"  # where this instance serves its KV (a producer), as peers reach it
    kv_port: int = 0  # 0: a free port, chosen at start
    # timeout_s: a consumer gives up on a silent producer, a producer frees blocks nobody fetched;
    # use_shm: same-host transfers through shared memory (else always TCP).
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_cli(cls, value: "str | dict | KVTransferConfig | None") -> Optional["KVTransferConfig"]:
        if value is None or isinstance(value, KVTransferConfig):
            return value
        value = fields_from_json(value, cls, "kv_transfer_config")
        cfg = cls(**value)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(
                f"kv_transfer_config.kv_connector must be one of {KV_CONNECTORS}, got {self.kv_connector!r}"
            )
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ValueError(f"kv_transfer_config.kv_ip must be a host name or address, got {self.kv_ip!r}")
        if not isinstance(self.kv_port, int) or isinstance(self.kv_port, bool) or not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_transfer_config.kv_port must be an integer in [0, 65535], got {self.kv_port!r}")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be an object")
        t = extra.get("timeout_s", 30.0)
        if not isinstance(t, (int, float)) or isinstance(t, bool) or t <= 0:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config.timeout_s must be a number > 0, got {t!r}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def timeout_s(self) -> float:
        return float(self.kv_connector_extra_config.get("timeout_s", 30.0))

    @property
    def use_shm(self) -> bool:
        return bool(self.kv_connector_extra_config.get("use_shm", True))

    def resolve_port(self) -> None:
        """A producer with kv_port 0 takes a free port now, so that the scheduler side (which
        writes it into kv_transfer_params) and the worker side (which binds it) agree."""
        if self.is_producer and self.kv_port == 0:
            with socket.socket() as s:
                s.bind((self.kv_ip, 0))
                self.kv_port = s.getsockname()[1]


def validate_kv_transfer_params(params) -> None:
    """ValueError naming the field for a request's kv_transfer_params that cannot be used (the
    prefill instance's answer is passed back as it was)."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params must be an object")
    if params.get("do_remote_prefill"):
        need = {"remote_host": str, "remote_port": int, "remote_request_id": str, "remote_block_ids": list}
        for key, typ in need.items():
            v = params.get(key)
            if not isinstance(v, typ) or isinstance(v, bool):
                raise ValueError(
                    f"kv_transfer_params.{key} must be a {typ.__name__} (pass back the prefill "
                    f"response's kv_transfer_params), got {v!r}"
                )
        if not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in params["remote_block_ids"]):
            raise ValueError("kv_transfer_params.remote_block_ids must be block ids (integers > 0)")
