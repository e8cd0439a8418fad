"""Executor.get_class picks the executor from ParallelConfig (no model loaded), and the default
submit / finish pair of a one-batch executor is execute_model."""

from types import SimpleNamespace

import pytest

from pagedllm.config import ParallelConfig
from pagedllm.executor import Executor


def _config(**parallel):
    return SimpleNamespace(parallel_config=ParallelConfig(**parallel))


@pytest.mark.parametrize(
    "parallel, name",
    [
        ({}, "UniProcExecutor"),
        ({"distributed_executor_backend": "ray"}, "UniProcExecutor"),  # one process: no transport
        ({"tensor_parallel_size": 2}, "MultiprocExecutor"),
        ({"pipeline_parallel_size": 2, "distributed_executor_backend": "mp"}, "MultiprocExecutor"),
        ({"tensor_parallel_size": 2, "distributed_executor_backend": "ray"}, "RayDistributedExecutor"),
    ],
)
def test_get_class(parallel, name):
    cls = Executor.get_class(_config(**parallel))
    assert cls.__name__ == name and issubclass(cls, Executor)


def test_get_class_rejects_unknown_backend():
    with pytest.raises(ValueError, match="'mp' or 'ray'"):
        Executor.get_class(_config(tensor_parallel_size=2, distributed_executor_backend="slurm"))


def test_one_batch_executor_submit_finish_is_execute_model():
    class Echo(Executor):
        def execute_model(self, so):
            return ("ran", so)

    ex = Echo(_config(), eos_token_ids=[2, 2, 7])
    assert ex.eos_token_ids == frozenset({2, 7}) and ex.max_concurrent_batches == 1
    assert ex.finish(ex.submit("so")) == ("ran", "so")
    with pytest.raises(NotImplementedError):
        ex.reset()
