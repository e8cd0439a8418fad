"""--scheduling-policy priority on the scheduler alone (a fake runner, milliseconds): the waiting
queue is served by (priority, arrival); a waiting request that cannot start preempts running
requests of lower priority, the lowest (then newest) first; a running request short of a block
preempts the lowest-priority one. The orders asserted are worked out by hand."""

from __future__ import annotations

import random

import pytest

from pagedllm.request import Request
from test_scheduler import Sim, make_request, make_scheduler


def prio(rid: str, prompt_len: int, priority: int, arrival: float, **params) -> Request:
    r = make_request(rid, prompt_len, **params)
    r.priority, r.arrival_time = priority, arrival
    return r


class PrioritySim(Sim):
    """Sim's block and runner invariants, with the priority policy's order instead of FCFS's."""

    def check_schedule(self, so, had_work, waiting_before, running_before, computed_before) -> None:
        s, ns = self.sched, so.num_scheduled_tokens
        assert so.total_num_scheduled_tokens == sum(ns.values()) <= self.cfg.max_num_batched_tokens
        assert len(ns) <= self.cfg.max_num_seqs and all(n > 0 for n in ns.values())
        if had_work:
            assert so.total_num_scheduled_tokens > 0, "a step with unfinished requests did nothing"
        key = {rid: r.priority_key() for rid, r in self.reqs.items()}
        # The victims rank below (or with) every running request that stayed.
        survivors = [rid for rid, _ in running_before if rid not in so.preempted_req_ids]
        for v in so.preempted_req_ids:
            assert all(key[v] >= key[rid] for rid in survivors), (v, survivors)
        # Admission takes the best of the waiting queue: nobody left waiting ranks above an admitted one.
        admitted = [nr.req_id for nr in so.scheduled_new_reqs if nr.req_id not in dict(running_before)]
        left = [r.request_id for r in s.waiting if r.request_id not in so.preempted_req_ids]
        for a in admitted:
            assert all(key[a] <= key[w] for w in left), (a, left)


def first_scheduled_order(sim: Sim) -> list[str]:
    order: list[str] = []
    while sim.sched.has_unfinished_requests():
        so, _ = sim.step()
        order += [nr.req_id for nr in so.scheduled_new_reqs if nr.req_id not in order]
    sim.check_all_done()
    return order


@pytest.mark.parametrize("policy, expected", [("fcfs", ["A", "B", "C", "D"]), ("priority", ["D", "B", "C", "A"])])
def test_waiting_requests_start_by_priority_then_arrival(policy, expected):
    # One sequence at a time: the order of admission is the queue's order.
    sim = (PrioritySim if policy == "priority" else Sim)(make_scheduler(max_num_seqs=1, scheduling_policy=policy))
    sim.add(
        prio("A", 5, 5, 0.0, max_tokens=2),
        prio("B", 5, 0, 1.0, max_tokens=2),
        prio("C", 5, 0, 2.0, max_tokens=2),
        prio("D", 5, -1, 3.0, max_tokens=2),
    )
    assert first_scheduled_order(sim) == expected


def test_a_better_arrival_preempts_the_lowest_running_request_for_its_sequence_slot():
    sim = PrioritySim(make_scheduler(max_num_seqs=2, scheduling_policy="priority"))
    sim.add(prio("A", 5, 1, 0.0, max_tokens=8), prio("B", 5, 2, 1.0, max_tokens=8))
    sim.step()
    sim.add(prio("C", 5, 0, 2.0, max_tokens=8))
    so, _ = sim.step()
    assert so.preempted_req_ids == {"B"}  # the lowest priority, not the newest (C)
    assert [nr.req_id for nr in so.scheduled_new_reqs] == ["C"]  # admitted in the same step
    assert set(so.num_scheduled_tokens) == {"A", "C"}
    assert [r.request_id for r in sim.sched.waiting] == ["B"]
    sim.run()
    sim.check_all_done()


@pytest.mark.parametrize("priority", [2, 3])  # B, the lowest running, has 2
def test_an_equal_or_lower_arrival_waits(priority):
    sim = PrioritySim(make_scheduler(max_num_seqs=2, scheduling_policy="priority"))
    sim.add(prio("A", 5, 1, 0.0, max_tokens=8), prio("B", 5, 2, 1.0, max_tokens=8))
    sim.step()
    sim.add(prio("C", 5, priority, 2.0, max_tokens=8))
    so, _ = sim.step()
    assert not so.preempted_req_ids and not so.scheduled_new_reqs
    sim.run()
    sim.check_all_done()


def test_a_better_arrival_takes_the_blocks_it_needs_and_no_more():
    # 6 usable blocks of 4: A, B, C (8-token prompts, priorities 1, 3, 2) hold 2 each + decode slack.
    sim = PrioritySim(make_scheduler(num_blocks=7, block_size=4, max_num_seqs=8, scheduling_policy="priority"))
    sim.add(prio("A", 7, 1, 0.0, max_tokens=1), prio("B", 7, 3, 1.0, max_tokens=8), prio("C", 7, 2, 2.0, max_tokens=8))
    sim.step()  # A ends at once (max_tokens 1): its blocks come back
    assert sim.kv.num_free_blocks() == 2
    # D needs 3 blocks (11 tokens): one victim (B, the lowest) frees 2, enough.
    sim.add(prio("D", 11, 0, 3.0, max_tokens=2))
    so, _ = sim.step()
    assert so.preempted_req_ids == {"B"}
    assert "D" in [nr.req_id for nr in so.scheduled_new_reqs] and "C" in so.num_scheduled_tokens
    sim.run()
    sim.check_all_done()


def test_a_running_request_short_of_a_block_preempts_the_lowest_priority_not_the_newest():
    # 4 usable blocks: A (priority 5, older) and B (priority 0, newer) take 2 each.
    sim = PrioritySim(make_scheduler(num_blocks=5, block_size=4, scheduling_policy="priority"))
    sim.add(prio("A", 7, 5, 0.0, max_tokens=4), prio("B", 7, 0, 1.0, max_tokens=4))
    sim.step()
    sim.step()
    assert sim.kv.num_free_blocks() == 0
    so, _ = sim.step()  # both need a 3rd block; B is served first, A (the lowest) goes
    assert so.preempted_req_ids == {"A"} and so.num_scheduled_tokens == {"B": 1}
    sim.run()
    sim.check_all_done()


@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_keep_the_order_and_leak_no_block(seed):
    rng = random.Random(seed)
    num_blocks, block_size = rng.choice([6, 9, 17]), rng.choice([2, 4])
    room = (num_blocks - 1) * block_size  # every request fits the cache alone, or it could never end
    sim = PrioritySim(
        make_scheduler(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=rng.choice([1, 2, 4]),
            max_num_batched_tokens=rng.choice([4, 16, 64]),
            preemption_mode=rng.choice(["recompute", "swap"]),
            num_cpu_blocks=8,
            scheduling_policy="priority",
        )
    )
    arrivals = sorted((rng.randint(0, 20), i) for i in range(rng.randint(1, 12)))
    while arrivals or sim.sched.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= sim.steps:
            _, i = arrivals.pop(0)
            prompt_len = rng.randint(1, min(10, room - 1))
            sim.add(
                prio(
                    f"r{i}",
                    prompt_len,
                    rng.choice([-2, 0, 0, 1, 7]),
                    float(sim.steps),
                    max_tokens=rng.randint(1, min(8, room - prompt_len)),
                )
            )
        if sim.sched.has_unfinished_requests():
            sim.step()
        else:
            sim.steps += 1
        assert sim.steps < 2000
    sim.check_all_done()
