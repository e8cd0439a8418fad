"""Scheduler unit tests with a fake model runner: no torch, no model, milliseconds.

`FakeRunner` keeps each request's tokens the way the real runner does (from
scheduled_new_reqs / scheduled_cached_reqs, dropping preempted and finished ids) and
samples one token for a request when the step reaches its last known token. `Sim` drives
schedule → execute → update and checks the scheduler's invariants after every call.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Callable, Optional

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager, cdiv
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams

EOS = 2


# ====================================================================== fakes
@dataclass
class _Row:
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed: int
    block_ids: list[int]


# token_fn(req_id, step, output_index) -> token id
TokenFn = Callable[[str, int, int], int]


def default_token(req_id: str, step: int, k: int) -> int:
    return 1000 + step


class FakeRunner:
    """Stands in for ModelRunner.execute_model: tracks rows like the persistent batch, and a
    fake KV cache (the token id each slot holds) on the device and in the swap space, so that
    a block moved to the wrong place or lost is seen when its request reads it again."""

    def __init__(self, block_size: int, token_fn: TokenFn = default_token) -> None:
        self.block_size = block_size
        self.token_fn = token_fn
        self.step = 0
        self.rows: dict[str, _Row] = {}
        self.sampled: defaultdict[str, list[int]] = defaultdict(list)  # every token it sampled
        self.kv: defaultdict[int, list] = defaultdict(lambda: [None] * block_size)  # device blocks
        self.cpu: defaultdict[int, list] = defaultdict(lambda: [None] * block_size)  # swap space

    def _move_kv(self, so: SchedulerOutput) -> None:
        """Swap-out, swap-in, then copy-on-write copies, in the real runner's order."""
        for dev, cpu in so.blocks_to_swap_out:
            self.cpu[cpu] = list(self.kv[dev])
        for cpu, dev in so.blocks_to_swap_in:
            self.kv[dev] = list(self.cpu[cpu])
        for src, dst in so.blocks_to_copy:
            self.kv[dst] = list(self.kv[src])

    def _attend(self, row: _Row, n: int) -> None:
        """Check that the cache holds the row's computed tokens, then write the next n."""
        bs = self.block_size
        seen = [self.kv[row.block_ids[p // bs]][p % bs] for p in range(row.num_computed)]
        assert seen == row.token_ids[: row.num_computed], "the KV cache lost or moved a token"
        for p in range(row.num_computed, row.num_computed + n):
            self.kv[row.block_ids[p // bs]][p % bs] = row.token_ids[p]

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.step += 1
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.rows.pop(rid, None)
        self._move_kv(so)
        for nr in so.scheduled_new_reqs:
            assert nr.req_id not in self.rows, f"{nr.req_id} added twice to the batch"
            self.rows[nr.req_id] = _Row(
                list(nr.token_ids), nr.num_prompt_tokens, nr.num_computed_tokens, list(nr.block_ids)
            )
        for cr in so.scheduled_cached_reqs:
            row = self.rows[cr.req_id]
            assert row.num_computed == cr.num_computed_tokens
            row.block_ids.extend(cr.new_block_ids)
        assert set(so.num_scheduled_tokens) == (
            {r.req_id for r in so.scheduled_new_reqs} | {r.req_id for r in so.scheduled_cached_reqs}
        )
        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            row = self.rows[rid]
            assert n > 0
            assert row.num_computed + n <= len(row.token_ids), "scheduled past the known tokens"
            # The block table covers every slot written this step.
            assert len(row.block_ids) >= cdiv(row.num_computed + n, self.block_size)
            self._attend(row, n)
            row.num_computed += n
            req_ids.append(rid)
            if row.num_computed == len(row.token_ids):
                tok = self.token_fn(rid, self.step, len(row.token_ids) - row.num_prompt_tokens)
                row.token_ids.append(tok)
                self.sampled[rid].append(tok)
                sampled.append([tok])
            else:
                sampled.append([])  # mid-prefill chunk: nothing to sample
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    chunked_prefill: bool = True,
    enable_caching: bool = False,
    preemption_mode: str = "recompute",
    num_cpu_blocks: int = 0,
    scheduling_policy: str = "fcfs",
) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        chunked_prefill=chunked_prefill,
        preemption_mode=preemption_mode,
        scheduling_policy=scheduling_policy,
    )
    return Scheduler(
        cfg, KVCacheManager(num_blocks, block_size, enable_caching=enable_caching, num_cpu_blocks=num_cpu_blocks)
    )


def make_request(rid: str, prompt_len: int, eos: Optional[int] = EOS, **params) -> Request:
    params.setdefault("max_tokens", 16)
    prompt = [10 + (7 * i + len(rid)) % 500 for i in range(prompt_len)]  # never EOS, never >= 1000
    return Request(rid, prompt, SamplingParams(**params), eos_token_id=eos, arrival_time=0.0)


# ====================================================================== harness
class Sim:
    """schedule → execute → update with every invariant checked (requests with n == 1)."""

    def __init__(self, sched: Scheduler, token_fn: TokenFn = default_token, check_progress: bool = True) -> None:
        self.sched = sched
        self.cfg = sched.config
        self.kv = sched.kv_cache_manager
        self.bs = self.kv.block_size
        self.num_blocks = self.kv.block_pool.num_blocks
        self.caching = self.kv.block_pool.enable_caching
        self.num_cpu_blocks = len(self.kv.free_cpu_blocks) + 1 if self.kv.free_cpu_blocks else 0
        self.runner = FakeRunner(self.bs, token_fn)
        self.check_progress = check_progress
        self.reqs: dict[str, Request] = {}  # every request ever added, finished included
        self.outputs: defaultdict[str, list] = defaultdict(list)
        self.sched_outputs: list[SchedulerOutput] = []
        self.steps = 0

    # ------------------------------------------------------------ driving
    def add(self, *reqs: Request) -> None:
        for r in reqs:
            self.sched.add_request(r)
            self.reqs[r.request_id] = r
        self.check_state()

    def schedule(self) -> SchedulerOutput:
        s = self.sched
        had_work = s.has_unfinished_requests()
        waiting_before = [r.request_id for r in s.waiting]
        running_before = [(r.request_id, r.num_tokens - r.num_computed_tokens) for r in s.running]
        computed_before = {r.request_id: r.num_computed_tokens for r in s.running}
        # Swapped-out requests keep their computed tokens and resume from there.
        computed_before.update((r.request_id, r.num_computed_tokens) for r in s.waiting if self.kv.is_swapped(r))
        so = s.schedule()
        self.sched_outputs.append(so)
        self.check_schedule(so, had_work, waiting_before, running_before, computed_before)
        self.check_state()
        return so

    def execute_and_update(self, so: SchedulerOutput) -> list:
        ro = self.runner.execute_model(so)
        outs = self.sched.update_from_output(so, ro)
        for o in outs:
            self.outputs[o.req_id].append(o)
        self.check_state()
        self.check_runner_agrees()
        self.steps += 1
        return outs

    def step(self):
        so = self.schedule()
        return so, self.execute_and_update(so)

    def run(self, max_steps: int = 10_000) -> None:
        while self.sched.has_unfinished_requests():
            assert self.steps < max_steps, "the scheduler does not terminate"
            self.step()

    def abort(self, *rids: str) -> list[Request]:
        s = self.sched
        # Blocks only these requests hold (shared prefix-cache blocks stay with the others).
        refs = Counter(b.block_id for rid in set(rids) if rid in s.requests for b in self.kv.req_to_blocks.get(rid, ()))
        held = sum(1 for bid, c in refs.items() if self.kv.block_pool.blocks[bid].ref_cnt == c)
        free_before = self.kv.num_free_blocks()
        live = {rid for rid in rids if rid in s.requests}
        done = s.finish_requests(rids, RequestStatus.FINISHED_ABORTED)
        assert {r.request_id for r in done} == live
        for r in done:
            assert r.status == RequestStatus.FINISHED_ABORTED and r.get_finished_reason().value == "abort"
            assert r.request_id not in self.kv.req_to_blocks
            assert r.request_id in s.finished_req_ids
        assert self.kv.num_free_blocks() == free_before + held  # every block came back
        self.check_state()
        return done

    # ------------------------------------------------------------ invariants
    def check_schedule(self, so, had_work, waiting_before, running_before, computed_before) -> None:
        cfg = self.cfg
        ns = so.num_scheduled_tokens
        assert so.total_num_scheduled_tokens == sum(ns.values())
        assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(ns) <= cfg.max_num_seqs
        assert all(n > 0 for n in ns.values())
        if had_work and self.check_progress:
            assert so.total_num_scheduled_tokens > 0, "a step with unfinished requests did nothing"
        new_ids = [r.req_id for r in so.scheduled_new_reqs]
        cached_ids = [r.req_id for r in so.scheduled_cached_reqs]
        # Batch order: running requests first, then the admitted ones.
        assert list(ns) == cached_ids + new_ids
        # FCFS: the admitted requests are exactly the head of the waiting queue, in order.
        assert new_ids == waiting_before[: len(new_ids)]
        # Preemption takes the newest running requests, and then nobody is admitted.
        running_ids = [rid for rid, _ in running_before]
        k = len(so.preempted_req_ids)
        assert so.preempted_req_ids == set(running_ids[len(running_ids) - k :])
        if k:
            assert not new_ids
        survivors = running_ids[: len(running_ids) - k]
        # Running requests are served in order (oldest first); all but the last scheduled
        # one get everything they need, and waiting ones only get what the running left.
        assert cached_ids == survivors[: len(cached_ids)]
        need = dict(running_before)
        for rid in cached_ids[:-1]:
            assert ns[rid] == need[rid]
        if new_ids:
            assert cached_ids == survivors
            assert all(ns[rid] == need[rid] for rid in cached_ids)
        if len(cached_ids) < len(survivors):
            # Someone running was left out: only because the budget ran out.
            assert so.total_num_scheduled_tokens == cfg.max_num_batched_tokens
        for cr in so.scheduled_cached_reqs:
            assert cr.num_computed_tokens == computed_before[cr.req_id]
        for nr in so.scheduled_new_reqs:
            r = self.reqs[nr.req_id]
            if nr.req_id in computed_before:  # a swapped request resumes where it was
                assert nr.num_computed_tokens == computed_before[nr.req_id] > 0
            elif self.caching:  # prefix-cache hits: whole blocks, never the last token
                assert nr.num_computed_tokens % self.bs == 0 and nr.num_computed_tokens < r.num_tokens
            else:
                assert nr.num_computed_tokens == 0
            assert nr.token_ids == r.all_token_ids  # a resumed request brings its output
            assert nr.num_prompt_tokens == r.num_prompt_tokens
            assert nr.block_ids == self.kv.get_block_ids(nr.req_id)
            if not cfg.chunked_prefill:  # no chunking: all of it at once
                assert ns[nr.req_id] == r.num_tokens - nr.num_computed_tokens

    def check_state(self) -> None:
        s, kv = self.sched, self.kv
        pool = kv.block_pool
        running = {r.request_id: r for r in s.running}
        waiting = {r.request_id: r for r in s.waiting}
        assert len(running) == len(s.running) and len(waiting) == len(s.waiting)
        assert not running.keys() & waiting.keys()
        assert running.keys() | waiting.keys() == s.requests.keys()
        assert len(s.running) <= self.cfg.max_num_seqs
        # Ownership: only running requests hold blocks; a block's ref count is its number of
        # holders; without prefix caching no block is held by two requests.
        owner: defaultdict[int, list[str]] = defaultdict(list)
        for rid, blocks in kv.req_to_blocks.items():
            if blocks:
                assert rid in running, f"{rid} holds blocks but is not running"
            assert len({b.block_id for b in blocks}) == len(blocks)
            for b in blocks:
                assert b is not pool.null_block and b.block_id != 0
                owner[b.block_id].append(rid)
        for block_id, holders in owner.items():
            assert pool.blocks[block_id].ref_cnt == len(holders)
            if not self.caching:
                assert len(holders) == 1, f"block {block_id} is held by {holders}"
        for rid, r in running.items():
            assert r.status == RequestStatus.RUNNING
            assert 0 < r.num_computed_tokens <= r.num_tokens
            assert len(kv.req_to_blocks.get(rid, ())) == cdiv(r.num_computed_tokens, self.bs)
        for rid, r in waiting.items():
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            if kv.is_swapped(r):  # its KV in the swap space, one CPU block per device block
                assert r.status == RequestStatus.PREEMPTED and self.cfg.preemption_mode == "swap"
                assert len(kv.req_to_cpu_blocks[rid]) == cdiv(r.num_computed_tokens, self.bs)
            else:
                assert r.num_computed_tokens == 0
            assert not kv.req_to_blocks.get(rid)
        # Only waiting requests are swapped out; the swap space's free and held CPU blocks
        # partition it (block 0 unused).
        assert kv.req_to_cpu_blocks.keys() <= waiting.keys()
        cpu_held = [b for blocks in kv.req_to_cpu_blocks.values() for b in blocks]
        assert sorted(cpu_held + kv.free_cpu_blocks) == list(range(1, self.num_cpu_blocks))
        # Preempted requests sit in front of never-run ones (first come first served).
        statuses = [r.status for r in s.waiting]
        if self.cfg.scheduling_policy == "fcfs":
            assert statuses == sorted(statuses, key=lambda status: status != RequestStatus.PREEMPTED)
        # The free queue and the held blocks partition the pool.
        free_ids = pool.free_queue.block_ids()
        assert len(free_ids) == pool.get_num_free_blocks() == kv.num_free_blocks()
        assert len(set(free_ids)) == len(free_ids)
        assert not set(free_ids) & owner.keys()
        assert 0 not in free_ids
        assert all(pool.blocks[i].ref_cnt == 0 for i in free_ids)
        assert len(free_ids) + len(owner) == self.num_blocks - 1
        assert pool.null_block.ref_cnt == 1

    def check_runner_agrees(self) -> None:
        """After update_from_output, the runner's rows and the scheduler's requests agree."""
        for r in self.sched.running:
            row = self.runner.rows[r.request_id]
            assert row.token_ids == r.all_token_ids
            assert row.num_computed == r.num_computed_tokens

    def check_all_done(self) -> None:
        s, kv = self.sched, self.kv
        assert not s.has_unfinished_requests() and not s.requests
        assert kv.num_free_blocks() == self.num_blocks - 1
        assert not any(kv.req_to_blocks.values())
        assert not kv.req_to_cpu_blocks and len(kv.free_cpu_blocks) == max(self.num_cpu_blocks - 1, 0)
        for rid, r in self.reqs.items():
            assert r.is_finished(), r
        # Every request's end is announced to the runner exactly once.
        announced = [rid for so in self.sched_outputs for rid in so.finished_req_ids]
        announced += list(s.finished_req_ids)
        assert sorted(announced) == sorted(self.reqs)


# ====================================================================== budget / max_num_seqs
def test_budget_and_max_num_seqs_are_kept_every_step():
    sim = Sim(make_scheduler(num_blocks=200, max_num_seqs=3, max_num_batched_tokens=10))
    sim.add(*(make_request(f"r{i}", 3 + 5 * i, max_tokens=4 + i) for i in range(7)))
    saw_full = False
    while sim.sched.has_unfinished_requests():
        so, _ = sim.step()
        assert so.total_num_scheduled_tokens <= 10
        assert len(so.num_scheduled_tokens) <= 3 and len(sim.sched.running) <= 3
        saw_full |= so.total_num_scheduled_tokens == 10
        assert sim.steps < 500
    assert saw_full
    sim.check_all_done()
    for i in range(7):
        assert sim.reqs[f"r{i}"].num_output_tokens == 4 + i


def test_max_num_seqs_holds_back_admission():
    sim = Sim(make_scheduler(max_num_seqs=2, max_num_batched_tokens=100))
    sim.add(*(make_request(f"r{i}", 4, max_tokens=3) for i in range(4)))
    so, _ = sim.step()
    assert [r.req_id for r in so.scheduled_new_reqs] == ["r0", "r1"]
    assert [r.request_id for r in sim.sched.waiting] == ["r2", "r3"]
    sim.run()
    sim.check_all_done()


@pytest.mark.parametrize("n, num_parents", [(2, 3), (3, 2)])
def test_max_num_seqs_counts_every_parallel_sample(n, num_parents):
    """A request with n > 1 forks into n running sequences: they count against max_num_seqs
    (the model runner's batch has max_num_seqs rows)."""
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    runner = FakeRunner(sched.kv_cache_manager.block_size)
    for p in range(num_parents):
        sched.add_request(make_request(f"p{p}", 6, max_tokens=3, n=n))
    steps = 0
    while sched.has_unfinished_requests():
        so = sched.schedule()
        assert len(so.num_scheduled_tokens) <= sched.config.max_num_seqs
        assert len(sched.running) <= sched.config.max_num_seqs
        sched.update_from_output(so, runner.execute_model(so))
        steps += 1
        assert steps < 100
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks() == kv.block_pool.num_blocks - 1


# ====================================================================== FCFS
def test_a_later_short_request_never_jumps_a_long_one_short_of_blocks():
    # 4 usable blocks of 4 tokens; budget is ample, blocks are not.
    sim = Sim(make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64))
    sim.add(make_request("A", 8, max_tokens=4))  # 2 blocks
    sim.step()
    sim.add(make_request("B", 12, max_tokens=2))  # needs 3 blocks: only 2 free
    sim.add(make_request("C", 2, max_tokens=2))  # would fit in one block
    order = []
    while sim.sched.has_unfinished_requests():
        so, _ = sim.step()
        order += [r.req_id for r in so.scheduled_new_reqs if r.req_id not in order]
        if "B" not in order:
            assert "C" not in order
    assert order == ["B", "C"]
    sim.check_all_done()


def test_a_later_short_request_never_jumps_a_long_one_short_of_budget_without_chunking():
    sim = Sim(make_scheduler(max_num_batched_tokens=20, max_model_len=40, chunked_prefill=False))
    sim.add(make_request("A1", 3, max_tokens=5), make_request("A2", 3, max_tokens=6))
    sim.step()
    sim.add(make_request("B", 19, max_tokens=2))  # 19 > 20 - 2 decodes: waits, no chunk
    sim.add(make_request("C", 1, max_tokens=2))  # 1 token would fit
    admitted = []
    while sim.sched.has_unfinished_requests():
        so, _ = sim.step()
        admitted += [r.req_id for r in so.scheduled_new_reqs]
        if any(r.req_id == "B" for r in so.scheduled_new_reqs):
            assert so.num_scheduled_tokens["B"] == 19
    assert admitted == ["B", "C"]
    sim.check_all_done()


def test_waiting_requests_are_admitted_in_arrival_order():
    sim = Sim(make_scheduler(max_num_seqs=2, max_num_batched_tokens=7))
    lens = [9, 2, 5, 1, 7, 3]
    sim.add(*(make_request(f"r{i}", n, max_tokens=2) for i, n in enumerate(lens)))
    admitted = []
    while sim.sched.has_unfinished_requests():
        so, _ = sim.step()
        admitted += [r.req_id for r in so.scheduled_new_reqs]
    assert admitted == [f"r{i}" for i in range(len(lens))]
    sim.check_all_done()


# ====================================================================== chunked prefill
def test_chunked_prefill_splits_a_long_prompt_and_the_chunks_sum_to_it():
    sim = Sim(make_scheduler(max_num_batched_tokens=16))
    sim.add(make_request("long", 50, max_tokens=3))
    chunks = []
    while not sim.reqs["long"].output_token_ids:
        so, outs = sim.step()
        chunks.append(so.num_scheduled_tokens["long"])
        # Nothing is sampled until the last chunk.
        assert bool(outs) == (sum(chunks) == 50)
    assert chunks == [16, 16, 16, 2]
    assert sum(chunks) == 50
    # Then one token per step.
    so, _ = sim.step()
    assert so.num_scheduled_tokens == {"long": 1}
    sim.run()
    assert sim.reqs["long"].num_output_tokens == 3
    sim.check_all_done()


def test_chunked_prefill_shares_the_budget_with_a_decoding_request():
    sim = Sim(make_scheduler(max_num_batched_tokens=8))
    sim.add(make_request("dec", 3, max_tokens=10))
    sim.step()  # dec's prompt; now it decodes
    sim.add(make_request("long", 20, max_tokens=2))
    so, _ = sim.step()
    assert so.num_scheduled_tokens == {"dec": 1, "long": 7}
    chunks = [7]
    while not sim.reqs["long"].output_token_ids:
        so, _ = sim.step()
        assert so.num_scheduled_tokens["dec"] == 1
        chunks.append(so.num_scheduled_tokens["long"])
    assert sum(chunks) == 20
    sim.run()
    sim.check_all_done()


def test_without_chunked_prefill_a_prompt_is_scheduled_whole():
    sim = Sim(make_scheduler(max_num_batched_tokens=32, max_model_len=32, chunked_prefill=False))
    sim.add(make_request("a", 30, max_tokens=2), make_request("b", 5, max_tokens=2))
    so, _ = sim.step()
    assert so.num_scheduled_tokens == {"a": 30}  # b (5) does not fit in the 2 left: waits
    so, _ = sim.step()
    assert so.num_scheduled_tokens == {"a": 1, "b": 5}
    sim.run()
    sim.check_all_done()


# ====================================================================== running before waiting
def test_running_requests_are_served_before_waiting_ones():
    sim = Sim(make_scheduler(max_num_batched_tokens=10))
    sim.add(make_request("old", 10, max_tokens=5))
    sim.add(make_request("new", 4, max_tokens=5))
    so, _ = sim.step()
    assert so.num_scheduled_tokens == {"old": 10}  # the whole budget on the earlier request
    so, _ = sim.step()
    assert list(so.num_scheduled_tokens) == ["old", "new"]
    assert so.num_scheduled_tokens == {"old": 1, "new": 4}
    sim.run()
    sim.check_all_done()


def test_a_running_prefill_keeps_the_budget_from_waiting_requests():
    sim = Sim(make_scheduler(max_num_batched_tokens=8))
    sim.add(make_request("long", 30, max_tokens=1))
    sim.step()
    sim.add(make_request("short", 1, max_tokens=1))
    for _ in range(2):
        so, _ = sim.step()
        assert so.num_scheduled_tokens == {"long": 8}
    so, _ = sim.step()
    assert so.num_scheduled_tokens == {"long": 6, "short": 1}
    sim.run()
    sim.check_all_done()


# ====================================================================== preemption
def test_preemption_takes_the_newest_returns_all_its_blocks_and_it_resumes_intact():
    # 4 usable blocks of 4 tokens: A and B (7-token prompts) take 2 each.
    sim = Sim(make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64))
    sim.add(make_request("A", 7, max_tokens=4), make_request("B", 7, max_tokens=4))
    sim.step()  # prefills, 1 token each: 8 tokens, 7 computed
    sim.step()  # token 7 computed: still 2 blocks each
    assert sim.kv.num_free_blocks() == 0
    b = sim.reqs["B"]
    b_out_before = list(b.output_token_ids)
    assert len(b_out_before) == 2
    so, _ = sim.step()  # A needs a 3rd block: B, the newest, is preempted
    assert so.preempted_req_ids == {"B"}
    assert "B" not in so.num_scheduled_tokens and so.num_scheduled_tokens == {"A": 1}
    assert not so.scheduled_new_reqs
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and sim.sched.num_preemptions == 1
    assert sim.sched.waiting[0] is b
    assert "B" not in sim.kv.req_to_blocks
    # All of B's blocks came back: A holds 3, one is free.
    assert len(sim.kv.get_block_ids("A")) == 3
    assert sim.kv.num_free_blocks() == 4 - 3
    assert b.output_token_ids == b_out_before
    resumed = None
    while sim.sched.has_unfinished_requests():
        so, _ = sim.step()
        for nr in so.scheduled_new_reqs:
            if nr.req_id == "B":
                resumed = nr
    # B came back with its prompt and its two tokens, all recomputed, and went on.
    assert resumed is not None
    assert resumed.token_ids == b.prompt_token_ids + b_out_before
    assert resumed.num_computed_tokens == 0
    assert b.num_output_tokens == 4 and b.output_token_ids[:2] == b_out_before
    assert b.output_token_ids == sim.runner.sampled["B"]
    assert b.output_token_ids == sorted(set(b.output_token_ids))  # 1000 + step: continues
    assert b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert sim.reqs["A"].num_output_tokens == 4
    sim.check_all_done()


def test_preemption_spares_older_requests():
    # Block size 2, 6 usable blocks: A, B, C take 2 each.
    sim = Sim(make_scheduler(num_blocks=7, block_size=2, max_num_batched_tokens=64))
    sim.add(*(make_request(x, 4, max_tokens=3) for x in "ABC"))
    sim.step()
    assert sim.kv.num_free_blocks() == 0
    so, _ = sim.step()  # all need a 3rd block: C goes, A and B each get one of its two
    assert so.preempted_req_ids == {"C"}
    assert so.num_scheduled_tokens == {"A": 1, "B": 1}
    assert [r.request_id for r in sim.sched.running] == ["A", "B"]
    assert [r.request_id for r in sim.sched.waiting] == ["C"]
    sim.run()
    assert all(sim.reqs[x].num_output_tokens == 3 for x in "ABC")
    sim.check_all_done()


def test_preempted_requests_go_back_in_front_of_waiting_ones_oldest_first():
    sim = Sim(make_scheduler(num_blocks=7, block_size=2, max_num_batched_tokens=64))
    sim.add(*(make_request(x, 4, max_tokens=2) for x in "ABC"))
    sim.step()
    sim.add(make_request("D", 1, max_tokens=1))
    # Make A need 2 more blocks at once (as 3 accepted tokens would): both B and C must go.
    sim.reqs["A"].append_output_token_ids([1001, 1002, 1003])
    sim.runner.rows["A"].token_ids.extend([1001, 1002, 1003])
    sim.reqs["A"].sampling_params.max_tokens = sim.reqs["A"].max_tokens = 5
    so = sim.schedule()
    assert so.preempted_req_ids == {"B", "C"}
    assert [r.request_id for r in sim.sched.waiting] == ["B", "C", "D"]
    sim.execute_and_update(so)
    sim.run()
    sim.check_all_done()


def test_the_scheduled_request_itself_is_the_victim_when_it_is_the_newest():
    # 4 usable blocks of 2: A has 2, B has 2. A needs nothing new, B needs a 3rd block.
    sim = Sim(make_scheduler(num_blocks=5, block_size=2, max_num_batched_tokens=64))
    sim.add(make_request("A", 3, max_tokens=3), make_request("B", 4, max_tokens=3))
    sim.step()  # A: 3 computed + 1 sampled (4 tokens, 2 blocks); B: 4 computed + 1 (5 tokens)
    assert sim.kv.num_free_blocks() == 0
    so, _ = sim.step()
    assert so.num_scheduled_tokens == {"A": 1}
    assert so.preempted_req_ids == {"B"}
    assert sim.reqs["B"].status == RequestStatus.PREEMPTED
    assert sim.kv.num_free_blocks() == 2
    sim.run()
    assert sim.reqs["A"].num_output_tokens == 3 and sim.reqs["B"].num_output_tokens == 3
    sim.check_all_done()


# ====================================================================== abort
def test_abort_a_running_request_between_steps():
    sim = Sim(make_scheduler())
    sim.add(make_request("a", 9, max_tokens=10), make_request("b", 5, max_tokens=3))
    sim.step()
    assert len(sim.kv.get_block_ids("a")) == 3
    free = sim.kv.num_free_blocks()
    (a,) = sim.abort("a")
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert sim.kv.num_free_blocks() == free + 3
    so, _ = sim.step()
    assert "a" in so.finished_req_ids and "a" not in so.num_scheduled_tokens
    assert "a" not in sim.runner.rows
    so, _ = sim.step()
    assert "a" not in so.finished_req_ids
    assert sim.abort("a") == []  # already over: nothing happens
    sim.run()
    sim.check_all_done()


def test_abort_a_waiting_and_a_preempted_request():
    sim = Sim(make_scheduler(num_blocks=5, block_size=4, max_num_seqs=2))
    sim.add(make_request("A", 7, max_tokens=4), make_request("B", 7, max_tokens=4))
    sim.add(make_request("W", 3, max_tokens=2))  # waits: max_num_seqs
    sim.step()
    sim.step()
    so, _ = sim.step()
    assert so.preempted_req_ids == {"B"}
    assert [r.request_id for r in sim.sched.waiting] == ["B", "W"]
    free = sim.kv.num_free_blocks()
    sim.abort("W", "B", "nonexistent")
    assert sim.kv.num_free_blocks() == free  # they held nothing
    assert not sim.sched.waiting
    so, _ = sim.step()
    assert so.finished_req_ids == {"W", "B"}
    assert not so.scheduled_new_reqs
    sim.run()
    assert sim.reqs["A"].num_output_tokens == 4
    assert sim.reqs["B"].num_output_tokens == 2 and sim.reqs["W"].num_output_tokens == 0
    sim.check_all_done()


def test_abort_mid_step_drops_the_sampled_token():
    sim = Sim(make_scheduler())
    sim.add(make_request("a", 5, max_tokens=10), make_request("b", 5, max_tokens=2))
    sim.step()
    so = sim.schedule()
    assert "a" in so.num_scheduled_tokens
    out_before = list(sim.reqs["a"].output_token_ids)
    sim.abort("a")  # the step is already on the device
    outs = sim.execute_and_update(so)
    assert all(o.req_id != "a" for o in outs)
    assert sim.reqs["a"].output_token_ids == out_before
    assert sim.reqs["a"].status == RequestStatus.FINISHED_ABORTED
    so, _ = sim.step()
    assert "a" in so.finished_req_ids
    sim.run()
    sim.check_all_done()


def test_abort_mid_prefill_returns_its_blocks():
    sim = Sim(make_scheduler(num_blocks=20, block_size=4, max_num_batched_tokens=8))
    sim.add(make_request("p", 40, max_tokens=2))
    sim.step()
    sim.step()
    assert len(sim.kv.get_block_ids("p")) == 4
    sim.abort("p")
    assert sim.kv.num_free_blocks() == 19
    sim.step()
    sim.check_all_done()


# ====================================================================== stop conditions
def scripted(script: dict[str, list[int]]) -> TokenFn:
    def fn(rid, step, k):
        s = script.get(rid, [])
        return s[k] if k < len(s) else 1000 + step

    return fn


def test_max_tokens_finishes_with_length():
    sim = Sim(make_scheduler())
    sim.add(make_request("r", 5, max_tokens=3))
    sim.run()
    r = sim.reqs["r"]
    assert r.num_output_tokens == 3 and r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    outs = sim.outputs["r"]
    assert [o.finish_reason for o in outs] == [None, None, "length"]
    assert [t for o in outs for t in o.new_token_ids] == r.output_token_ids
    sim.check_all_done()


def test_eos_finishes_with_stop_and_is_kept_in_the_output():
    sim = Sim(make_scheduler(), token_fn=scripted({"r": [500, 501, EOS, 503]}))
    sim.add(make_request("r", 5, max_tokens=10))
    sim.run()
    r = sim.reqs["r"]
    assert r.output_token_ids == [500, 501, EOS]
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason is None
    assert sim.outputs["r"][-1].finish_reason == "stop" and sim.outputs["r"][-1].stop_reason is None
    sim.check_all_done()


def test_eos_is_ignored_with_ignore_eos():
    sim = Sim(make_scheduler(), token_fn=scripted({"r": [EOS, EOS, EOS, EOS]}))
    sim.add(make_request("r", 5, max_tokens=4, ignore_eos=True))
    sim.run()
    r = sim.reqs["r"]
    assert r.output_token_ids == [EOS] * 4 and r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    sim.check_all_done()


def test_eos_before_min_tokens_does_not_stop():
    sim = Sim(make_scheduler(), token_fn=scripted({"r": [EOS] * 10}))
    sim.add(make_request("r", 5, max_tokens=10, min_tokens=3))
    sim.run()
    r = sim.reqs["r"]
    assert r.output_token_ids == [EOS] * 3 and r.status == RequestStatus.FINISHED_STOPPED
    sim.check_all_done()


def test_request_without_eos_token_never_stops_on_it():
    sim = Sim(make_scheduler(), token_fn=scripted({"r": [EOS] * 10}))
    sim.add(make_request("r", 5, eos=None, max_tokens=4))
    sim.run()
    assert sim.reqs["r"].num_output_tokens == 4
    assert sim.reqs["r"].status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_stop_token_ids_finish_with_stop_and_stop_reason():
    sim = Sim(make_scheduler(), token_fn=scripted({"r": [500, 777, 501], "m": [777, 777, 777]}))
    sim.add(make_request("r", 5, max_tokens=10, stop_token_ids=[777, 778]))
    sim.add(make_request("m", 5, max_tokens=10, stop_token_ids=[777], min_tokens=2))
    sim.run()
    r, m = sim.reqs["r"], sim.reqs["m"]
    assert r.output_token_ids == [500, 777]
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 777
    last = sim.outputs["r"][-1]
    assert last.finish_reason == "stop" and last.stop_reason == 777
    assert m.output_token_ids == [777, 777] and m.stop_reason == 777
    sim.check_all_done()


def test_max_model_len_finishes_with_length():
    sim = Sim(make_scheduler(max_model_len=13))
    sim.add(make_request("r", 10, max_tokens=100), make_request("n", 4, max_tokens=None))
    sim.run()
    r, n = sim.reqs["r"], sim.reqs["n"]
    assert r.num_output_tokens == 3 and r.num_tokens == 13
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert n.num_output_tokens == 9 and n.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert sim.outputs["r"][-1].finish_reason == "length"
    sim.check_all_done()


def test_duplicate_request_id_is_refused():
    s = make_scheduler()
    s.add_request(make_request("x", 3))
    with pytest.raises(ValueError):
        s.add_request(make_request("x", 3))
    assert s.get_num_unfinished_requests() == 1


def test_step_with_nothing_to_do_is_empty():
    sim = Sim(make_scheduler())
    so = sim.schedule()
    assert so.num_scheduled_tokens == {} and so.total_num_scheduled_tokens == 0
    sim.execute_and_update(so)


# ====================================================================== randomized
@dataclass
class _Spec:
    prompt_len: int
    max_tokens: Optional[int]
    min_tokens: int
    ignore_eos: bool
    stop_ids: list[int]
    script: list[int]
    arrival: int
    abort: Optional[tuple[int, bool]]  # (step, mid-step)


def expected_end(spec: _Spec, max_model_len: int) -> tuple[int, set[str]]:
    """Number of output tokens and the acceptable finish statuses (both when stop and length
    fall on the same token, whichever the scheduler checks first)."""
    c = 0
    while True:
        tok = spec.script[c] if c < len(spec.script) else 1_000_000
        c += 1
        reasons = set()
        if c >= spec.min_tokens:
            if not spec.ignore_eos and tok == EOS:
                reasons.add("stop")
            elif tok in spec.stop_ids:
                reasons.add("stop")
        if spec.prompt_len + c >= max_model_len or (spec.max_tokens is not None and c >= spec.max_tokens):
            reasons.add("length")
        if reasons:
            return c, reasons


@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(4, 48))
    chunked = draw(st.booleans())
    caching = draw(st.booleans())
    if chunked:
        budget = draw(st.integers(1, 40))
    else:
        budget = draw(st.integers(max_model_len, max_model_len + 16))
    max_num_seqs = draw(st.integers(1, 6))
    specs = []
    for _ in range(draw(st.integers(1, 8))):
        max_tokens = draw(st.one_of(st.none(), st.integers(1, 20)))
        min_tokens = draw(st.integers(0, max_tokens if max_tokens is not None else 5))
        specs.append(
            _Spec(
                prompt_len=draw(st.integers(1, max_model_len)),
                max_tokens=max_tokens,
                min_tokens=min_tokens,
                ignore_eos=draw(st.booleans()),
                stop_ids=draw(st.sampled_from([[], [7], [7, 9]])),
                script=draw(st.lists(st.sampled_from([EOS, 7, 9, 500, 501, 502]), max_size=12)),
                arrival=draw(st.integers(0, 8)),
                abort=draw(st.one_of(st.none(), st.none(), st.tuples(st.integers(0, 30), st.booleans()))),
            )
        )
    # Every request must fit the cache alone, or it could never finish (it would preempt
    # itself forever): it holds KV for at most all its tokens but the last sampled one.
    most = max(cdiv(s.prompt_len + expected_end(s, max_model_len)[0] - 1, block_size) for s in specs)
    num_blocks = 1 + most + draw(st.one_of(st.just(0), st.integers(0, 3), st.integers(0, 10)))
    # Swap: a swap space from none (every preemption falls back to recompute) to ample.
    mode = draw(st.sampled_from(["recompute", "swap"]))
    num_cpu_blocks = draw(st.one_of(st.integers(0, 4), st.integers(4, 64))) if mode == "swap" else 0
    return dict(
        block_size=block_size,
        max_model_len=max_model_len,
        chunked=chunked,
        caching=caching,
        budget=budget,
        max_num_seqs=max_num_seqs,
        num_blocks=num_blocks,
        specs=specs,
        mode=mode,
        num_cpu_blocks=num_cpu_blocks,
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_workload_keeps_every_invariant_and_finishes(sc):
    specs: list[_Spec] = sc["specs"]
    max_model_len = sc["max_model_len"]
    sched = make_scheduler(
        num_blocks=sc["num_blocks"],
        block_size=sc["block_size"],
        max_num_seqs=sc["max_num_seqs"],
        max_num_batched_tokens=sc["budget"],
        max_model_len=max_model_len,
        chunked_prefill=sc["chunked"],
        enable_caching=sc["caching"],
        preemption_mode=sc["mode"],
        num_cpu_blocks=sc["num_cpu_blocks"],
    )
    script = {f"r{i}": s.script for i, s in enumerate(specs)}
    sim = Sim(sched, token_fn=scripted(script))
    # Liveness bound: the oldest running request can always grow (it fits alone and is never
    # the one preempted), so each step computes >= 1 of its at most prompt + output tokens.
    cap = max(s.arrival for s in specs) + sum(s.prompt_len + expected_end(s, max_model_len)[0] for s in specs) + 2
    aborted: set[str] = set()

    def do_aborts(step: int, mid: bool) -> None:
        for i, s in enumerate(specs):
            rid = f"r{i}"
            if s.abort == (step, mid) and rid in sim.reqs:  # arrived; maybe already over
                aborted.update(r.request_id for r in sim.abort(rid))

    step = 0
    while True:
        for i, s in enumerate(specs):
            if s.arrival == step:
                sim.add(
                    make_request(
                        f"r{i}",
                        s.prompt_len,
                        max_tokens=s.max_tokens,
                        min_tokens=s.min_tokens,
                        ignore_eos=s.ignore_eos,
                        stop_token_ids=s.stop_ids,
                    )
                )
        do_aborts(step, False)
        if not sim.sched.has_unfinished_requests() and step > max(s.arrival for s in specs):
            break
        so = sim.schedule()
        do_aborts(step, True)
        sim.execute_and_update(so)
        step += 1
        assert step <= cap, f"no end after {step} steps"
    sim.check_all_done()
    event(f"preemptions: {min(sched.num_preemptions, 3)}{'+' if sched.num_preemptions > 3 else ''}")
    if sc["mode"] == "swap" and sched.num_preemptions:
        event(
            f"swap: {sched.num_swaps} of {sched.num_preemptions} preemptions swapped"
            if sched.num_swaps < 3
            else "swap: 3+ swaps"
        )
    event(f"aborted: {bool(aborted)}")
    event(f"chunked: {sc['chunked']}")
    event(f"prefix hits: {any(max(r.num_cached_tokens, 0) > 0 for r in sim.reqs.values())}")
    event(f"stopped: {any(r.status == RequestStatus.FINISHED_STOPPED for r in sim.reqs.values())}")

    for i, s in enumerate(specs):
        rid = f"r{i}"
        r = sim.reqs[rid]
        n, reasons = expected_end(s, max_model_len)
        want = [s.script[k] if k < len(s.script) else None for k in range(r.num_output_tokens)]
        got = [t if t < 1000 else None for t in r.output_token_ids]
        assert got == want, "the output was not continued where it stopped"
        if rid in aborted:
            assert r.status == RequestStatus.FINISHED_ABORTED
            assert r.num_output_tokens <= n
            assert r.output_token_ids == sim.runner.sampled[rid][: r.num_output_tokens]
            continue
        assert r.num_output_tokens == n
        assert r.get_finished_reason().value in reasons
        assert r.output_token_ids == sim.runner.sampled[rid]
        outs = sim.outputs[rid]
        assert [t for o in outs for t in o.new_token_ids] == r.output_token_ids
        assert [o.finish_reason for o in outs[:-1]] == [None] * (len(outs) - 1)
        assert outs[-1].finish_reason == r.get_finished_reason().value
        if r.status == RequestStatus.FINISHED_STOPPED:
            last = r.output_token_ids[-1]
            assert r.stop_reason == (None if (last == EOS and not s.ignore_eos) else last)
        else:
            assert r.stop_reason is None
        # Tokens sampled by the model (1000 + step) keep increasing across preemptions.
        model_toks = [t for t in r.output_token_ids if t >= 1000]
        assert model_toks == sorted(set(model_toks))
