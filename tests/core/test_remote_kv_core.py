"""The scheduler's remote-KV bookkeeping (core/remote_kv.py) with a fake connector: no torch,
milliseconds. A consumer whose loaded requests hold every block while the head of the queue
cannot start must not wait for ever."""

from __future__ import annotations

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput
from pagedllm.distributed.kv_transfer.base import KVConnectorOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams


class FakeConnector:
    """The scheduler side of a consumer: a request with remote params loads its whole prompt once."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not (params and params.get("do_remote_prefill")):
            return 0, False
        return request.num_prompt_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request, block_ids, num_external_tokens: int) -> None:
        request.kv_transfer_params["do_remote_prefill"] = False  # once: later it recomputes

    def build_connector_meta(self, scheduler_output, requests, get_block_ids):
        return None

    def request_finished(self, request, block_ids):
        return False, None


def _request(rid: str, remote: bool) -> Request:
    request = Request(rid, list(range(10, 18)), SamplingParams(max_tokens=8, ignore_eos=True), arrival_time=0.0)
    if remote:  # what the fake connector reads (the real params name the producer's blocks)
        request.kv_transfer_params = {"do_remote_prefill": True}
    return request


def test_loaded_requests_behind_a_blocked_head_give_their_blocks_back():
    """6 blocks of 4 tokens, one sequence at a time: R (local, 8 tokens) runs while B and C (8 tokens
    each, remote) load into the other 4 blocks. R's 9th token needs a block: R is preempted and,
    first in the queue, needs 3 blocks where 2 are free, with nothing running. B and C, loaded
    behind it, give theirs back (they compute their prompt here later) and everyone finishes."""
    kv = KVCacheManager(7, 4)
    assert kv.num_free_blocks() == 6
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64), kv, connector=FakeConnector()
    )
    reqs = [_request("R", False), _request("B", True), _request("C", True)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"R"} and kv.num_free_blocks() == 0
    assert reqs[1].status == reqs[2].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    loaded = KVConnectorOutput(finished_recving={"B", "C"})
    sched.update_from_output(out, ModelRunnerOutput(["R"], [[1]], kv_connector_output=loaded))
    finished, preemptions, idle = set(), 0, 0
    for _ in range(60):  # bounded: a deadlock schedules nothing for ever
        out = sched.schedule()
        idle = 0 if out.total_num_scheduled_tokens else idle + 1
        if idle == 3:  # (a step that preempts admits nothing: the next one does)
            break
        ids = list(out.num_scheduled_tokens)
        last = [
            r.request_id for r in reqs if r.request_id in ids and r.num_computed_tokens >= r.num_tokens
        ]  # the step reaches its last token
        outputs = sched.update_from_output(out, ModelRunnerOutput(ids, [[2] if i in last else [] for i in ids]))
        finished |= {o.req_id for o in outputs if o.finish_reason is not None}
        preemptions = sched.num_preemptions
    assert finished == {"R", "B", "C"}, (finished, [(r.request_id, r.status) for r in reqs])
    assert preemptions >= 3 and kv.num_free_blocks() == 6  # R once, B and C released
