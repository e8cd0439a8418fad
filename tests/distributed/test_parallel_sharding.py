"""Who holds what under tensor / pipeline parallelism (no processes): every query head, KV
head, intermediate column, vocabulary row and layer is covered, and each rank's attention is
plain grouped-query attention over its own KV heads, also when the heads do not divide."""

import pytest

from pagedllm.distributed.sharding import plan_model_shard, plan_tp_shard, split_range, validate_parallel_sizes

SMOLLM2 = {
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "num_hidden_layers": 30,
}


def test_split_range_partitions():
    for n in range(0, 20):
        for parts in range(1, 6):
            ranges = [split_range(n, parts, i) for i in range(parts)]
            assert [x for r in ranges for x in r] == list(range(n))
            assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


def test_smollm2_over_two_ranks_is_uneven_by_kv_head():
    r0 = plan_tp_shard(9, 3, 1536, 49152, 2, 0)
    r1 = plan_tp_shard(9, 3, 1536, 49152, 2, 1)
    assert (r0.kv_heads, r0.q_heads) == (range(0, 1), range(0, 3))  # the driver: the smaller share
    assert (r1.kv_heads, r1.q_heads) == (range(1, 3), range(3, 9))
    assert (r0.intermediate, r1.intermediate) == (range(0, 768), range(768, 1536))
    assert (r0.vocab, r1.vocab) == (range(0, 24576), range(24576, 49152))


def _check_tp(num_heads, num_kv, tp):
    group = num_heads // num_kv
    seen = []
    for r in range(tp):
        s = plan_tp_shard(num_heads, num_kv, 100, 1000, tp, r)
        assert len(s.q_heads) >= 1
        assert len(s.q_heads) % len(s.kv_heads) == 0  # uniform groups on the rank
        local_group = len(s.q_heads) // len(s.kv_heads)
        for i, h in enumerate(s.q_heads):  # q head -> its KV head, locally
            assert h // group == s.kv_heads.start + i // local_group
        if num_kv < tp:
            assert len(s.kv_heads) == 1  # replicated KV head
        seen.extend(s.q_heads)
    assert sorted(seen) == list(range(num_heads))  # each query head exactly once


@pytest.mark.parametrize("num_heads,num_kv", [(9, 3), (8, 8), (32, 8), (12, 4), (14, 2), (9, 1), (64, 8)])
def test_every_head_once_with_uniform_local_groups(num_heads, num_kv):
    for tp in range(1, num_heads + 1):
        try:
            _check_tp(num_heads, num_kv, tp)
        except ValueError as e:
            # Only refused when some rank sharing a KV head would get no query head.
            assert "too large" in str(e)
            assert num_kv < tp


def test_refusals_name_the_limit():
    with pytest.raises(ValueError, match="too large.*4 query heads, 2 KV heads"):
        plan_tp_shard(4, 2, 100, 100, 6, 0)
    with pytest.raises(ValueError, match="tensor_parallel_size 10 is larger than the model's 9 query heads"):
        validate_parallel_sizes(SMOLLM2, 10, 1)
    with pytest.raises(ValueError, match="pipeline_parallel_size 31 is larger than the model's 30 layers"):
        validate_parallel_sizes(SMOLLM2, 1, 31)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        validate_parallel_sizes(SMOLLM2, 0, 1)


def test_pipeline_stages_partition_the_layers():
    shards = [plan_model_shard(SMOLLM2, 2, 3, rank) for rank in range(6)]
    assert [s.pp_rank for s in shards] == [0, 0, 1, 1, 2, 2]
    assert [s.tp.tp_rank for s in shards] == [0, 1, 0, 1, 0, 1]
    assert [shards[i].layers for i in (0, 2, 4)] == [range(0, 10), range(10, 20), range(20, 30)]
    assert shards[0].is_first_stage and not shards[0].is_last_stage and shards[5].is_last_stage
    assert [s.num_kv_heads for s in shards[:2]] == [1, 2]


@pytest.mark.model
def test_engine_args_validate_parallel_sizes(model_dir):
    from pagedllm.engine.arg_utils import EngineArgs

    cfg = EngineArgs(model=model_dir, tensor_parallel_size=3, pipeline_parallel_size=2).create_engine_config()
    assert cfg.parallel_config.world_size == 6
    with pytest.raises(ValueError, match="tensor_parallel_size 16 is larger"):
        EngineArgs(model=model_dir, tensor_parallel_size=16).create_engine_config()
    with pytest.raises(ValueError, match="distributed_executor_backend must be 'mp' or 'ray'"):
        EngineArgs(model=model_dir, distributed_executor_backend="mpi").create_engine_config()
    with pytest.raises(ValueError, match="data_parallel_size must be an integer >= 1"):
        EngineArgs(model=model_dir, data_parallel_size=0).create_engine_config()


def test_cli_flags():
    from pagedllm.entrypoints.cli import build_parser, engine_args_from

    ns = build_parser().parse_args(
        [
            "generate",
            "hi",
            "--tensor-parallel-size",
            "2",
            "-pp",
            "3",
            "--data-parallel-size",
            "2",
            "--distributed-executor-backend",
            "ray",
        ]
    )
    a = engine_args_from(ns)
    assert (a.tensor_parallel_size, a.pipeline_parallel_size, a.data_parallel_size, a.distributed_executor_backend) == (
        2,
        3,
        2,
        "ray",
    )
