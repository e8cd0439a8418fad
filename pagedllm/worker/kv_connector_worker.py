"""The worker side of a KV connector around a runner's steps (P/D disaggregation).

Loads start before the step's forward (they run on the connector's threads, across steps);
each attention layer's forward hook reports the layer written (`save_kv_layer`: a producer
serves that layer of the requests whose prefill completes in this step while the next layers
compute); `wait_for_save` after the forward covers steps that call no layer module (the C++
decode loop, a CUDA graph); the finished transfers ride back on the runner's output.
"""

from __future__ import annotations

from pagedllm.attention.layer import attention_layers
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed.kv_transfer.base import KVConnectorRole
from pagedllm.distributed.kv_transfer.factory import create_connector


class KVConnectorWorker:
    def __init__(self, config, runner) -> None:
        """After the runner's KV cache exists (its tensors are what the connector moves)."""
        self.connector = create_connector(
            config.kv_transfer_config, KVConnectorRole.WORKER, config.cache_config.block_size
        )
        self.connector.register_kv_caches(runner.kv_caches, config.cache_config.block_size)
        for i, layer in enumerate(attention_layers(runner.model).values()):
            layer.register_forward_hook(lambda *_, i=i: self.connector.save_kv_layer(i))

    def execute_model(self, runner, so: SchedulerOutput) -> ModelRunnerOutput:
        if so.kv_connector_metadata is not None:
            self.connector.start_load_kv(so.kv_connector_metadata)
        try:
            out = runner.execute_model(so)
        finally:
            self.connector.wait_for_save()
        out.kv_connector_output = self.connector.get_finished()
        return out

    def shutdown(self) -> None:
        self.connector.shutdown()
