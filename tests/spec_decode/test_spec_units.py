"""Speculative decoding without a model: the config's validation (ValueError / argparse error
naming the field), the n-gram proposer, the length policy, and the scheduler's part (drafts in
the budget and the block table, rejected drafts rolled back, never hashed into the prefix cache,
stop / max_tokens inside a multi-token step)."""

import argparse

import numpy as np
import pytest

from pagedllm.config import SchedulerConfig, SpeculativeConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput
from pagedllm.engine.arg_utils import _speculative_config
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.length_policy import SpecLengthPolicy
from pagedllm.spec_decode.ngram_proposer import NgramProposer


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"method": "medusa"}, "method"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": "3"}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max"),
        ({"method": "draft_model"}, "model"),
        ({"method": "draft_model", "model": "self:x"}, "model"),
        ({"method": "draft_model", "model": "/no/such/dir"}, "model"),
        ({"length_policy": "smart"}, "length_policy"),
        ({"k": 3}, "unknown field"),
    ],
)
def test_bad_config_names_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(bad)
    with pytest.raises(argparse.ArgumentTypeError, match=field):
        _speculative_config(__import__("json").dumps(bad))


def test_config_from_json_and_engine_checks():
    c = SpeculativeConfig.from_dict('{"method": "ngram", "num_speculative_tokens": 5}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 5, 2, 8)
    with pytest.raises(ValueError, match="JSON"):
        SpeculativeConfig.from_dict("{method: ngram}")
    from pagedllm import LLM

    with pytest.raises(ValueError, match="runner 'generate'"):
        LLM("random:tiny", runner="pooling", speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        LLM("random:tiny", speculative_config={"method": "mtp"})


def test_ngram_proposer_follows_the_longest_most_recent_match():
    p = NgramProposer(1, 3)
    toks = np.array([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3, 4])
    # [2, 3, 4] (the longest suffix, 3 <= max) occurs at 1 and at 6: the most recent one's
    # continuation, 2 (n - 1) = 4 tokens long at most.
    assert p.longest_match(toks) == (3, 8)
    assert p.propose_one(toks, 8) == [7, 8, 2, 3] and p.propose_one(toks, 2) == [7, 8]
    # [9, 3, 4] does not recur but [3, 4] does: the 2-gram's continuation, 2 tokens.
    assert p.propose_one(np.array([3, 4, 6, 1, 5, 9, 3, 4]), 8) == [6, 1]
    # A longer match wins over a more recent shorter one.
    assert NgramProposer(1, 8).propose_one(np.array([7, 1, 2, 3, 0, 2, 3, 5, 7, 1, 2, 3]), 8) == [0, 2, 3, 5, 7, 1]
    assert p.propose_one(np.array([1, 2, 3, 1]), 5) == [2]  # a 1-gram: one token
    assert p.propose_one(np.array([1, 2, 3]), 3) == []  # nothing recurs
    assert NgramProposer(2, 2).propose_one(np.array([5, 1, 7, 1]), 2) == []  # a 1-gram is too short
    assert SpeculativeConfig.from_dict({"prompt_lookup_max": 1}).prompt_lookup_min == 1


def test_adaptive_policy_speculates_less_as_acceptance_falls_and_the_batch_grows():
    fixed = SpecLengthPolicy(4, adaptive=False)
    assert fixed.num_spec_tokens(64) == 4
    p = SpecLengthPolicy(4, adaptive=True)
    for _ in range(50):
        p.observe(4, 4)
    high = p.num_spec_tokens(1)
    assert high == 4 and p.num_spec_tokens(32) < high
    for _ in range(80):
        p.observe(4, 0)
    picks = [p.num_spec_tokens(1) for _ in range(32)]
    assert picks.count(0) >= 30 and max(picks) == 1  # off, but probing now and then


def test_adaptive_policy_follows_the_measured_step_cost():
    """With steps timed as flat in the tokens (weight reads dominate) the policy drafts the most
    at a good acceptance; timed as linear in the tokens (arithmetic dominates: k + 1 tokens cost
    k + 1 steps) it drafts nothing even at acceptance 0.8, which the prior alone would take."""
    flat, linear = SpecLengthPolicy(4, adaptive=True), SpecLengthPolicy(4, adaptive=True)
    for p in (flat, linear):
        for _ in range(40):
            p.observe(4, 3)  # acceptance -> 0.75
    assert linear.num_spec_tokens(1) == 4  # the prior: every draft pays
    for n in range(1, 6):
        flat.cost.observe_step(n, 0.040 + 0.001 * n)
        linear.cost.observe_step(n, 0.040 * n)
    flat.cost.observe_proposal(4, 0.0004)
    assert flat.num_spec_tokens(1) == 4
    assert flat.cost.relative(1, 4) == pytest.approx((0.045 + 4 * 0.0001) / 0.041)
    assert [linear.num_spec_tokens(1) for _ in range(15)] == [0] * 15


# ------------------------------------------------------------ the scheduler's part
EOS = 2


def make(num_blocks=32, budget=64, caching=True):
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=64)
    return Scheduler(cfg, KVCacheManager(num_blocks, 4, enable_caching=caching))


def step(sched, tokens_for, drafts_for):
    so = sched.schedule()
    ids = list(so.num_scheduled_tokens)
    out = ModelRunnerOutput(
        req_ids=ids, sampled_token_ids=[tokens_for(r, so) for r in ids], spec_token_ids=[drafts_for(r) for r in ids]
    )
    return so, sched.update_from_output(so, out)


def test_drafts_are_budgeted_rolled_back_and_never_hashed():
    sched = make()
    req = Request("a", list(range(10, 17)), SamplingParams(max_tokens=20), eos_token_id=EOS)
    sched.add_request(req)
    so, _ = step(sched, lambda r, so: [100], lambda r: [101, 102, 103, 104])  # the prompt, drafts proposed
    assert req.num_computed_tokens == 7 and req.spec_token_ids == [101, 102, 103, 104]
    # 1 real token + 4 drafts scheduled; 1 accepted + the target's token -> 2 rejected slots rolled back.
    so, outs = step(sched, lambda r, so: [101, 50], lambda r: [])
    assert so.num_scheduled_tokens["a"] == 5 and so.scheduled_spec_decode_tokens == {"a": [101, 102, 103, 104]}
    assert outs[0].new_token_ids == [101, 50]
    assert req.num_computed_tokens == 9 and req.num_tokens == 10  # the last token is not computed yet
    blocks = sched.kv_cache_manager.req_to_blocks["a"]
    assert len(blocks) == 3  # slots for the drafts were given
    # Only blocks full of accepted tokens are hashed: 8 tokens -> 2 blocks, never the drafts' block.
    assert [b.block_hash is not None for b in blocks] == [True, True, False]
    assert sched.spec_decoding_stats.as_dict()["spec_decode_num_accepted_tokens_per_pos"] == [1, 0, 0, 0]


def test_budget_trims_drafts_and_stop_cuts_a_multi_token_step():
    sched = make(budget=3)
    req = Request("a", [10, 11], SamplingParams(max_tokens=6), eos_token_id=EOS)
    sched.add_request(req)
    step(sched, lambda r, so: [20], lambda r: [21, 22, 23, 24])
    so, _ = step(sched, lambda r, so: [21, 22, 23], lambda r: [24, 25, 26])
    assert so.scheduled_spec_decode_tokens == {"a": [21, 22]}  # budget 3 = 1 + 2 drafts
    # max_tokens 6 with 4 out: one more draft at most (the bonus makes the sixth), and an EOS
    # inside the step ends the request there: the tokens after it never reach the client.
    assert req.spec_token_ids == [24]
    so, outs = step(sched, lambda r, so: [EOS, 77], lambda r: [])
    assert outs[0].new_token_ids == [EOS] and outs[0].finish_reason == "stop"
    assert req.status == RequestStatus.FINISHED_STOPPED and req.output_token_ids == [20, 21, 22, 23, EOS]
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks - 1


def test_preemption_drops_the_drafts():
    sched = make(num_blocks=5)
    a = Request("a", list(range(10, 18)), SamplingParams(max_tokens=20), eos_token_id=EOS)
    b = Request("b", list(range(30, 37)), SamplingParams(max_tokens=20), eos_token_id=EOS)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, lambda r, so: [5], lambda r: [6, 7, 8, 9])
    so, _ = step(sched, lambda r, so: [6] if r == "a" else [], lambda r: [])
    assert "b" in so.preempted_req_ids and b.spec_token_ids == [] and b.num_computed_tokens == 0
