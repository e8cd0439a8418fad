"""Admission by a request's full width: what the scheduler admits always fits what the runner holds.

A request counts as every sequence it will fork into (n / best_of siblings, a beam search's
width) against max_num_seqs; a search's beams are preempted and admitted together, so a small
KV cache cannot leave a search half running forever; a prompt must leave room for one generated
token. Each test here failed before (`input batch is full`, an IndexError, a hang).
"""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

from server_utils import RemoteServer, wait_idle

TINY = "random:tiny"
PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15, 16]]


class WidthSpy:
    """Reads the scheduler after every core step: the most sequences running at once, by
    count and by their future width, and whether a search was ever split across queues."""

    def __init__(self, llm: LLM) -> None:
        self.core = llm.llm_engine.core
        self.max_running = self.max_width = 0
        self.split = []
        step = self.core.step

        def spied():
            out = step()
            sched = self.core.scheduler
            self.max_running = max(self.max_running, len(sched.running))
            self.max_width = max(self.max_width, sum(_width(r) for r in sched.running))
            groups_running = {getattr(r, "group_id", None) for r in sched.running} - {None}
            self.split += [r.request_id for r in sched.waiting if getattr(r, "group_id", None) in groups_running]
            return out

        self.core.step = spied

    def close(self) -> None:
        del self.core.step


def _width(request) -> int:
    return request.get_max_num_running_seqs()


def best(outs) -> list[list[int]]:
    return [[h.tokens for h in o.sequences] for o in outs]


@pytest.fixture(scope="module")
def llm8():
    llm = LLM(model=TINY, max_num_seqs=8, max_model_len=64)
    yield llm
    llm.shutdown()


def test_beam_searches_wider_together_than_max_num_seqs(llm8):
    """Three searches of width 5 with max_num_seqs 8: run one after another, each as if alone."""
    alone = [best(llm8.beam_search([p], beam_width=5, max_tokens=8))[0] for p in PROMPTS]
    spy = WidthSpy(llm8)
    try:
        together = best(llm8.beam_search(PROMPTS, beam_width=5, max_tokens=8))
    finally:
        spy.close()
    assert together == alone
    assert spy.max_running <= 8 and spy.max_width <= 8, (spy.max_running, spy.max_width)
    assert spy.max_running == 5  # one search at a time: 5 + 5 > 8


def test_parallel_samples_never_exceed_max_num_seqs(llm8):
    spy = WidthSpy(llm8)
    try:
        outs = llm8.generate(PROMPTS + [[20, 21]], SamplingParams(n=3, best_of=5, max_tokens=6, seed=1), use_tqdm=False)
    finally:
        spy.close()
    assert [len(o.outputs) for o in outs] == [3] * 4
    assert all(len(c.token_ids) == 6 for o in outs for c in o.outputs)
    assert spy.max_running <= 8 and spy.max_width <= 8


def test_width_above_max_num_seqs_is_refused(llm8):
    with pytest.raises(ValueError, match=r"beam_width \(9\) must be <= max_num_seqs \(8\)"):
        llm8.beam_search(PROMPTS, beam_width=9, max_tokens=4)
    with pytest.raises(ValueError, match=r"n / best_of \(9\) must be <= max_num_seqs \(8\)"):
        llm8.generate(PROMPTS, SamplingParams(n=9, max_tokens=4), use_tqdm=False)


def test_prompt_must_leave_room_for_one_token(llm8):
    with pytest.raises(ValueError, match=r"prompt has 64 tokens, more than max_model_len \(64\) allows: at most 63"):
        llm8.generate([list(range(3, 67))], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt has 64 tokens"):
        llm8.beam_search([list(range(3, 67))], beam_width=2, max_tokens=4)
    out = llm8.generate([list(range(3, 66))], SamplingParams(max_tokens=4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    assert (
        llm8.llm_engine.core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        == llm8.llm_engine.core.num_blocks - 1
    )


# A cache that holds one search of width 4 at full length (4 beams x 4 blocks of 4 tokens), not two.
SMALL_CACHE = dict(max_num_seqs=16, max_model_len=64, block_size=4, num_gpu_blocks=18)


@pytest.mark.parametrize("preemption_mode,prefix", [("recompute", True), ("recompute", False), ("swap", False)])
def test_beam_searches_in_a_cache_for_one_finish_as_alone(preemption_mode, prefix):
    """Searches that do not fit together take turns by preemption of whole searches; a beam
    left waiting for blocks while its siblings hold theirs would hang the search (it did)."""
    prompts = [[30 + i, 31 + i, 32 + i, 33 + i, 34 + i, 35 + i] for i in range(3)]
    big = LLM(model=TINY, max_num_seqs=16, max_model_len=64, block_size=4, enable_prefix_caching=prefix)
    try:
        alone = [best(big.beam_search([p], beam_width=4, max_tokens=10))[0] for p in prompts]
    finally:
        big.shutdown()
    llm = LLM(
        model=TINY, preemption_mode=preemption_mode, num_cpu_blocks=64, enable_prefix_caching=prefix, **SMALL_CACHE
    )
    try:
        spy = WidthSpy(llm)
        together = best(llm.beam_search(prompts, beam_width=4, max_tokens=10))
        core = llm.llm_engine.core
        assert together == alone
        assert core.scheduler.num_preemptions > 0
        if preemption_mode == "swap":
            assert core.scheduler.num_swaps > 0
        assert spy.split == []
        assert core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == core.num_blocks - 1
        # Width 5 at full length needs 20 blocks: refused up front, not left to hang.
        with pytest.raises(ValueError, match=r"5 beams of prompt \(6 tokens\) plus max_tokens \(10\) needs 20"):
            llm.beam_search(prompts[:1], beam_width=5, max_tokens=10)
    finally:
        llm.shutdown()


def test_unit_at_takes_the_contiguous_beams_of_a_search():
    from pagedllm.core.scheduler import _unit_at
    from pagedllm.request import Request

    reqs = [Request(f"r{i}", [1, 2], SamplingParams()) for i in range(6)]
    for r, g in zip(reqs, [None, "a", "a", "a", None, "b"]):
        r.group_id = g
    assert _unit_at(reqs, 0) == reqs[:1]
    assert _unit_at(reqs, 1) == _unit_at(reqs, 3) == reqs[1:4]
    assert _unit_at(reqs, 5) == reqs[5:]


def test_server_survives_beam_searches_wider_than_max_num_seqs():
    """Through the server: three concurrent width-5 searches with --max-num-seqs 8 used to kill
    the engine core (every later request: 503 engine_dead)."""
    import concurrent.futures as cf

    server = RemoteServer(["--model", TINY, "--max-num-seqs", "8", "--max-model-len", "64"])
    try:
        client = server.client()

        def search(i):
            return client.completions.create(
                model=TINY, prompt=[5 + i, 6, 7], max_tokens=6, n=5, extra_body={"use_beam_search": True}
            )

        with cf.ThreadPoolExecutor(3) as pool:
            results = list(pool.map(search, range(3)))
        assert [len(r.choices) for r in results] == [5, 5, 5]
        after = client.completions.create(model=TINY, prompt=[9, 10], max_tokens=3)
        assert len(after.choices[0].text.split()) == 3
        wait_idle(server)
    finally:
        server.close()
