"""KVConnectorFactory: the connector a KVTransferConfig names, for one side."""

from __future__ import annotations

from typing import Optional

from pagedllm.distributed.kv_transfer.base import KVConnectorBase, KVConnectorRole
from pagedllm.distributed.kv_transfer.config import KVTransferConfig


def create_connector(
    config: Optional[KVTransferConfig], role: KVConnectorRole, block_size: int
) -> Optional[KVConnectorBase]:
    if config is None:
        return None
    if config.kv_connector == "ZmqConnector":
        from pagedllm.distributed.kv_transfer.zmq_connector import ZmqConnector

        connector = ZmqConnector(config, role)
        connector.bind_block_size(block_size)
        return connector
    raise ValueError(f"kv_transfer_config.kv_connector {config.kv_connector!r} is not known")
