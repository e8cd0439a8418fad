"""Priority scheduling through the engine on `random:tiny`: with one sequence slot the requests
run in (priority, arrival) order, greedy outputs equal those of the first-come-first-served
engine (the order changes nothing in a request's tokens), and a priority on an FCFS engine, a
non-integer priority or an unknown policy is a ValueError naming the field."""

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
PRIORITIES = [3, 0, 3, -1]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def finish_order(policy: str, priorities: list[int]) -> tuple[list[str], dict[str, list[int]]]:
    engine = LLMEngine.from_engine_args(EngineArgs(model="random:tiny", max_num_seqs=1, scheduling_policy=policy))
    for i, (prompt, prio) in enumerate(zip(PROMPTS, priorities)):
        engine.add_request(f"r{i}", prompt, GREEDY, arrival_time=float(i), priority=prio)
    order, tokens = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
                tokens[out.request_id] = out.outputs[0].token_ids
    return order, tokens


def test_one_slot_runs_requests_by_priority_then_arrival_with_the_same_tokens():
    order, tokens = finish_order("priority", PRIORITIES)
    assert order == ["r3", "r1", "r0", "r2"]  # -1, 0, then the two 3s by arrival
    fcfs_order, fcfs_tokens = finish_order("fcfs", [0] * len(PROMPTS))
    assert fcfs_order == ["r0", "r1", "r2", "r3"]
    assert tokens == fcfs_tokens


def test_llm_generate_takes_a_priority_per_prompt():
    llm = LLM("random:tiny", max_num_seqs=1, scheduling_policy="priority")
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False, priority=PRIORITIES)
    fcfs = LLM("random:tiny").generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in fcfs]
    with pytest.raises(ValueError, match="priority has 1 entries for 4 prompts"):
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False, priority=[0])
    with pytest.raises(ValueError, match="priority must be an integer, got 1.5"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False, priority=[1.5])


def test_a_priority_needs_the_priority_policy():
    llm = LLM("random:tiny")
    with pytest.raises(ValueError, match="priority 2 needs --scheduling-policy priority"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False, priority=[2])
    assert not llm.llm_engine.has_unfinished_requests()


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match=r"scheduling_policy must be one of \('fcfs', 'priority'\), got 'lifo'"):
        EngineArgs(model="random:tiny", scheduling_policy="lifo").create_engine_config()
