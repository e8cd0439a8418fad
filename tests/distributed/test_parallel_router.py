"""The data-parallel router's decisions, with a fake engine (no model, no processes): repeated
prefixes stay on the replica that caches them, unrelated load spreads evenly, a much more
loaded replica loses its cache advantage, and a full set of replicas refuses at once."""

import random
from collections import Counter, defaultdict, deque

import pytest

from pagedllm.engine.dp_router import PrefixCacheAwareRouter, RouterOverloadedError, prompt_block_hashes

BS = 16


class FakeEngine:
    """K replicas that each finish up to `rate` requests per tick, oldest first."""

    def __init__(self, router: PrefixCacheAwareRouter, rate: int) -> None:
        self.router = router
        self.rate = rate
        self.queues = [deque() for _ in router.replicas]

    def submit(self, req_id, token_ids):
        d = self.router.route(req_id, token_ids)
        self.queues[d.replica].append(req_id)
        return d

    def tick(self):
        for q in self.queues:
            for _ in range(min(self.rate, len(q))):
                self.router.finish(q.popleft())


def _tokens(rng, n):
    return [rng.randrange(100, 49000) for _ in range(n)]


def test_hashes_match_the_kv_cache_manager():
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.request import Request
    from pagedllm.sampling_params import SamplingParams

    rng = random.Random(0)
    prompt = _tokens(rng, 5 * BS + 7)
    kv = KVCacheManager(64, BS, enable_caching=True)
    req = Request("r", prompt, SamplingParams(max_tokens=4), eos_token_id=2)
    assert prompt_block_hashes(prompt, BS) == kv._block_hashes(req)
    req.extra_keys = ("lora-1",)
    kv2 = KVCacheManager(64, BS, enable_caching=True)
    assert prompt_block_hashes(prompt, BS, ("lora-1",)) == kv2._block_hashes(req)
    assert prompt_block_hashes(prompt, BS, ("lora-1",)) != prompt_block_hashes(prompt, BS)


def test_repeated_prefixes_go_to_the_same_replica():
    rng = random.Random(1)
    router = PrefixCacheAwareRouter(4, BS, capacity_blocks=1000)
    engine = FakeEngine(router, rate=2)
    prefixes = [_tokens(rng, 4 * BS) for _ in range(8)]  # 8 "system prompts" of 4 blocks
    where = defaultdict(Counter)
    reasons = Counter()
    for i in range(400):
        p = rng.randrange(len(prefixes))
        d = engine.submit(f"r{i}", prefixes[p] + _tokens(rng, rng.randrange(5, 40)))
        where[p][d.replica] += 1
        reasons[d.reason, d.hit_blocks] += 1
        engine.tick()
    for p, counts in where.items():
        assert len(counts) == 1, f"prefix {p} went to replicas {dict(counts)}"
    # Only the first request of each prefix missed; every other one hit all 4 blocks.
    assert reasons == {("least-loaded", 0): 8, ("prefix", 4): 392}, reasons
    assert len({next(iter(c)) for c in where.values()}) > 1  # the prefixes are not all on one


def test_unrelated_load_spreads_evenly():
    rng = random.Random(2)
    router = PrefixCacheAwareRouter(4, BS, capacity_blocks=1000)
    engine = FakeEngine(router, rate=1)
    for i in range(400):
        engine.submit(f"r{i}", _tokens(rng, rng.randrange(8, 200)))
        if i % 3 == 0:
            engine.tick()
    counts = router.num_routed()
    assert sum(counts) == 400
    assert max(counts) - min(counts) <= 4, counts
    assert max(router.loads()) - min(router.loads()) <= 1


def test_a_much_more_loaded_replica_loses_its_cache_advantage():
    rng = random.Random(3)
    router = PrefixCacheAwareRouter(4, BS, capacity_blocks=1000, balance_abs=4, balance_ratio=0.5)
    hot = _tokens(rng, 8 * BS)
    decisions = [router.route(f"r{i}", hot + _tokens(rng, 10)) for i in range(60)]  # none finishes
    first = decisions[0].replica
    assert all(d.replica == first for d in decisions[:5])  # the hit wins while the gap is small
    assert any(d.reason == "balance" for d in decisions)
    loads = router.loads()
    assert loads[first] - min(loads) <= max(4, 0.5 * min(loads)) + 1, loads
    assert min(loads) > 0, loads  # every replica took some of the overflow
    # The overflow replicas now cache the hot prefix too, so they are preferred among equals.
    assert sum(d.hit_blocks > 0 for d in decisions[5:]) > 0


def test_refuses_early_when_every_replica_is_full():
    rng = random.Random(4)
    router = PrefixCacheAwareRouter(2, BS, capacity_blocks=100, max_load=3)
    for i in range(6):
        router.route(f"r{i}", _tokens(rng, 40))
    assert router.loads() == [3, 3]
    with pytest.raises(RouterOverloadedError, match="all 2 replicas are at their limit of 3"):
        router.route("r6", _tokens(rng, 40))
    assert "r6" not in router.owner
    router.finish("r0")
    assert router.route("r6", _tokens(rng, 40)).replica == 0


def test_a_full_replica_is_skipped_even_with_the_hit():
    rng = random.Random(5)
    router = PrefixCacheAwareRouter(2, BS, capacity_blocks=100, max_load=2, balance_abs=100)
    prefix = _tokens(rng, 4 * BS)
    assert router.route("a", prefix + [1]).replica == 0
    assert router.route("b", prefix + [2]).replica == 0
    d = router.route("c", prefix + [3])
    assert d.replica == 1 and d.hit_blocks == 0


def test_the_cache_estimate_forgets_least_recently_used_blocks():
    rng = random.Random(6)
    router = PrefixCacheAwareRouter(2, BS, capacity_blocks=8, balance_abs=100)
    old = _tokens(rng, 4 * BS)
    assert router.route("a", old + [1]).replica == 0
    router.finish("a")
    router.route("b", old + [2])  # the hit keeps it on replica 0
    assert router.owner["b"] == 0
    router.finish("b")
    for i in range(3):  # 12 other blocks through replica 0 evict `old`
        router.replicas[0].remember(prompt_block_hashes(_tokens(rng, 4 * BS), BS))
    decision, _ = router.choose(old + [3])
    assert decision.hit_blocks == 0 and decision.reason == "least-loaded"


# ---------------------------------------------------------------- the DP client, with fake cores
class FakeCoreClient:
    """What DPCoreClient needs of an EngineCoreClient, recording what it is sent."""

    def __init__(self):
        import asyncio

        self.sent = []
        self.inbox = asyncio.Queue()

    async def wait_ready(self, timeout):
        from pagedllm.core.kv_cache_utils import make_kv_cache_config
        from pagedllm.engine.messages import EngineCoreReady

        return EngineCoreReady(num_blocks=64, pid=0, kv_cache_config=make_kv_cache_config([None] * 2))

    def add_requests(self, requests):
        self.sent.append(("add", [r.request_id for r in requests]))

    def abort_requests(self, ids):
        self.sent.append(("abort", list(ids)))

    async def get_output(self):
        return await self.inbox.get()

    def added(self):
        return [rid for kind, ids in self.sent if kind == "add" for rid in ids]

    def aborts(self):
        return [ids for kind, ids in self.sent if kind == "abort"]

    def mark_dead(self, err):
        pass

    def shutdown(self, timeout=10.0):
        pass


def _config(k, max_num_seqs=4):
    from types import SimpleNamespace

    return SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_size=k),
        cache_config=SimpleNamespace(block_size=BS),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
    )


def _enc(req_id, prompt, n=1):
    from pagedllm.engine.messages import EngineCoreRequest
    from pagedllm.request import Request
    from pagedllm.sampling_params import SamplingParams

    return EngineCoreRequest.from_request(Request(req_id, prompt, SamplingParams(n=n), 2, 0.0))


def _outs(outputs=(), failed=(), **stats):
    """A replica's outputs message: (req_id, finish) outputs, failed request ids, its stats."""
    from pagedllm.core.scheduler_output import EngineCoreOutput
    from pagedllm.engine import messages as m

    base = {
        "running": 1,
        "waiting": 0,
        "used_blocks": 4,
        "num_blocks": 64,
        "preemptions": 0,
        "num_added": 2,
        "kv_usage": 4 / 64,
    }
    return m.EngineCoreOutputs(
        [EngineCoreOutput(rid, [5], finish_reason=fin) for rid, fin in outputs],
        m.SchedulerStats(**{**base, **stats}),
        failed=[m.FailedRequest(rid, "boom", False) for rid in failed],
    )


def test_dp_client_routes_adds_aborts_and_finishes():
    import asyncio
    from pagedllm.engine.exceptions import EngineOverloadedError
    from pagedllm.engine.dp_client import DPCoreClient

    async def run():
        rng = random.Random(7)
        fakes = [FakeCoreClient() for _ in range(2)]
        client = DPCoreClient(_config(2), {2}, clients=fakes, max_load=3)
        ready = await client.wait_ready(5)
        assert ready.num_blocks == 64
        system = _tokens(rng, 3 * BS)
        client.add_requests([_enc("a", system + [1]), _enc("b", system + [2])])
        client.add_requests([_enc("c", _tokens(rng, 40))])
        assert fakes[0].added() == ["a", "b"] and fakes[1].added() == ["c"]  # b follows a's prefix
        client.abort_requests(["b", "c"])
        assert fakes[0].aborts() == [["b"]] and fakes[1].aborts() == [["c"]]
        assert client.router.loads() == [1, 0]
        # A finished output lowers the load; the stats are summed over the replicas.
        fakes[0].inbox.put_nowait(_outs([("a", "length")]))
        fakes[1].inbox.put_nowait(_outs(used_blocks=12))
        msgs = [await asyncio.wait_for(client.get_output(), 5) for _ in range(2)]
        assert client.router.loads() == [0, 0]
        stats = msgs[-1].scheduler_stats
        assert stats.used_blocks == 16 and stats.num_blocks == 128 and stats.kv_usage == 16 / 128
        assert [r.used_blocks for r in stats.replicas] == [4, 12] and stats.router_loads == [0, 0]
        # n = 2: the parent's load ends with its second sample.
        client.add_requests([_enc("p", _tokens(rng, 40), n=2)])
        owner = client.router.owner["p"]
        fakes[owner].inbox.put_nowait(_outs([("0_p", "stop")]))
        await asyncio.wait_for(client.get_output(), 5)
        assert client.router.loads()[owner] == 1
        fakes[owner].inbox.put_nowait(_outs([("1_p", "stop")]))
        await asyncio.wait_for(client.get_output(), 5)
        assert client.router.loads() == [0, 0] and not client._parent_of
        # Both replicas full (3 each): refused at once, and nothing of the batch stays routed.
        client.add_requests([_enc(f"x{i}", _tokens(rng, 20)) for i in range(6)])
        with pytest.raises(EngineOverloadedError, match="all 2 replicas are at their limit"):
            client.add_requests([_enc("y", _tokens(rng, 20))])
        assert "y" not in client.router.owner and client.router.loads() == [3, 3]
        client.shutdown()

    asyncio.run(run())


def test_dp_client_failed_requests_lower_the_load():
    """Requests a failed core step ended ("f") leave the router's load as finished ones do; the
    siblings of a failed sample are then aborted on the replica that holds them."""
    import asyncio
    from pagedllm.engine.dp_client import DPCoreClient

    async def run():
        rng = random.Random(3)
        fakes = [FakeCoreClient() for _ in range(2)]
        client = DPCoreClient(_config(2), {2}, clients=fakes, max_load=3)
        await client.wait_ready(5)
        client.add_requests([_enc("a", _tokens(rng, 40)), _enc("p", _tokens(rng, 40), n=2)])
        owner = client.router.owner["p"]
        fakes[client.router.owner["a"]].inbox.put_nowait(_outs(failed=["a"]))
        await asyncio.wait_for(client.get_output(), 5)
        fakes[owner].inbox.put_nowait(_outs(failed=["1_p"]))
        await asyncio.wait_for(client.get_output(), 5)
        assert "a" not in client.router.owner and client.router.owner["p"] == owner
        client.abort_requests(["p", "0_p", "1_p"])  # what AsyncLLM sends next
        assert fakes[owner].aborts() == [["p", "0_p", "1_p"]]
        assert client.router.loads() == [0, 0] and not client._parent_of
        client.shutdown()

    asyncio.run(run())


def test_dp_client_liveness_and_a_replica_failure():
    """The replicas seen as one: alive while all are, the first dead one's exit code, every
    replica's sentinel to watch; a replica that reports it is dying fails get_output()."""
    import asyncio
    from pagedllm.engine.dp_client import DPCoreClient
    from pagedllm.engine.exceptions import EngineDeadError

    async def run():
        fakes = [FakeCoreClient() for _ in range(2)]
        for i, f in enumerate(fakes):
            f.is_alive, f.exit_code, f.sentinels = (lambda: True), None, (lambda i=i: [10 + i])
        client = DPCoreClient(_config(2), {2}, clients=fakes, max_load=3)
        await client.wait_ready(5)
        assert client.is_alive() and client.exit_code is None and client.sentinels() == [10, 11]
        fakes[1].is_alive, fakes[1].exit_code = (lambda: False), -9
        assert not client.is_alive() and client.exit_code == -9

        async def dying():
            raise EngineDeadError("the engine core failed: RuntimeError: CUDA out of memory")

        fakes[1].get_output = dying
        with pytest.raises(EngineDeadError, match="CUDA out of memory"):
            await asyncio.wait_for(client.get_output(), 5)
        client.shutdown()

    asyncio.run(run())
