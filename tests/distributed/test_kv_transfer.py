"""The ZMQ KV connector in one process (two offline engines): a consumer that loads a producer's
prefill over TCP and over shared memory holds the same K/V bytes in its blocks as the producer
and continues greedy decoding exactly as a colocated engine; bad configs and params are
ValueErrors naming the field."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams

MAX_LEN = 256


def _runner(llm):
    return llm.llm_engine.core.model_executor.driver_worker.model_runner


@pytest.fixture(scope="module")
def engines():
    ref = LLM("random:tiny", max_model_len=MAX_LEN)
    prod = LLM("random:tiny", max_model_len=MAX_LEN, kv_transfer_config={"kv_role": "kv_producer"})
    return ref, prod


@pytest.mark.parametrize("use_shm", [False, True])
def test_consumer_continues_producer_prefill(engines, use_shm):
    ref, prod = engines
    cons = LLM(
        "random:tiny",
        max_model_len=MAX_LEN,
        kv_transfer_config={"kv_role": "kv_consumer", "kv_connector_extra_config": {"use_shm": use_shm}},
    )
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (1, 17, 70)]
    greedy = dict(temperature=0, ignore_eos=True)
    want = [
        o.outputs[0].token_ids
        for o in ref.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=10, **greedy), use_tqdm=False
        )
    ]
    pre = prod.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}, **greedy),
        use_tqdm=False,
    )
    params = [o.kv_transfer_params for o in pre]
    assert all(p["do_remote_prefill"] and p["remote_block_ids"] for p in params)

    # The producer's prompt rows of each request, before they are fetched and freed.
    def rows(runner, block_ids, n):
        idx = (torch.tensor(block_ids)[:, None] * 16 + torch.arange(16)).reshape(-1)[:n]
        return [t[idx].clone() for layer in runner.kv_caches for t in layer]

    src = [rows(_runner(prod), kp["remote_block_ids"], len(p) - 1) for p, kp in zip(prompts, params)]
    # Spy (the real method still runs) on the blocks the consumer loads into.
    conn, dst_blocks = cons.llm_engine.core.scheduler.connector, {}
    orig = conn.update_state_after_alloc

    def spy(request, block_ids, n):
        dst_blocks[tuple(request.prompt_token_ids)] = list(block_ids)
        orig(request, block_ids, n)

    conn.update_state_after_alloc = spy
    outs = cons.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [SamplingParams(max_tokens=10, extra_args={"kv_transfer_params": kp}, **greedy) for kp in params],
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs] == want
    assert cons.llm_engine.core.scheduler.remote_kv.bytes_recved > 0
    for p, want_rows in zip(prompts, src):  # loaded byte for byte (the last prompt token is recomputed)
        got_rows = rows(_runner(cons), dst_blocks[tuple(p)], len(p) - 1)
        assert all(torch.equal(a, b) for a, b in zip(got_rows, want_rows))
    cons.llm_engine.core.shutdown()


@pytest.mark.parametrize(
    "cfg, field",
    [
        ('{"kv_role": "kv_prefill"}', "kv_role"),
        ('{"kv_connector": "Nope"}', "kv_connector"),
        ('{"kv_port": 70000}', "kv_port"),
        ('{"kv_connector_extra_config": {"timeout_s": 0}}', "timeout_s"),
        ('{"kv_rol": "kv_producer"}', "kv_rol"),
        ('not json', "JSON"),
    ],
)
def test_bad_kv_transfer_config(cfg, field):
    from pagedllm.distributed.kv_transfer.config import KVTransferConfig

    with pytest.raises(ValueError, match=field):
        KVTransferConfig.from_cli(cfg)


def test_bad_kv_transfer_params():
    with pytest.raises(ValueError, match="remote_port"):
        SamplingParams(
            extra_args={
                "kv_transfer_params": {
                    "do_remote_prefill": True,
                    "remote_host": "h",
                    "remote_request_id": "x",
                    "remote_block_ids": [1],
                }
            }
        )


@pytest.mark.timeout(180)
def test_consumer_cache_too_small_for_all_loads_recomputes(engines):
    """A consumer cache of 10 blocks and 6 loaded requests of 3-7 blocks each: loads, preemption
    and recompute here of requests whose load was used give one colocated engine's greedy output.
    (Loaded requests behind a blocked head holding every block for ever, the hang this once had:
    tests/core/test_remote_kv_core.py.)"""
    ref, prod = engines
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 512, (40,), generator=g).tolist()
    prompts = [
        shared + torch.randint(3, 512, (int(n),), generator=g).tolist() for n in torch.randint(5, 60, (6,), generator=g)
    ]
    greedy = dict(temperature=0, ignore_eos=True)
    want = [
        o.outputs[0].token_ids
        for o in ref.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=24, **greedy), use_tqdm=False
        )
    ]
    pre = prod.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}, **greedy),
        use_tqdm=False,
    )
    cons = LLM(
        "random:tiny",
        max_model_len=MAX_LEN,
        num_gpu_blocks=10,
        kv_transfer_config={"kv_role": "kv_consumer", "kv_connector_extra_config": {"use_shm": False}},
    )
    outs = cons.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [SamplingParams(max_tokens=24, extra_args={"kv_transfer_params": o.kv_transfer_params}, **greedy) for o in pre],
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs] == want
    sched = cons.llm_engine.core.scheduler
    assert sched.num_preemptions > 0 and sched.remote_kv.bytes_recved > 0
    cons.llm_engine.core.shutdown()
