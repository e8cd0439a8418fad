"""The seed's worked example (shared/seeds/003): block size 2, prompts of 3, 2 and 8 tokens,
token budget 10, max model len 12. The real Scheduler, KVCacheManager and InputBatch must
give every number of step 1 and step 2."""

import numpy as np

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import CachedRequestState, InputBatch

M = 12  # max model len


def T(r, i):
    """A distinct token id standing for T_r_i (request 2's prompt is written T_2_0, T_2_1,
    T_3_2 ... in the seed: one request, named with a typo there)."""
    return 100 * (r + 1) + i


def _apply(batch: InputBatch, so, runner_states):
    for data in so.scheduled_new_reqs:
        st = CachedRequestState(
            data.req_id,
            list(data.token_ids),
            data.num_prompt_tokens,
            data.sampling_params,
            list(data.block_ids),
            data.num_computed_tokens,
            None,
        )
        runner_states[data.req_id] = st
        batch.add_request(st)
    for data in so.scheduled_cached_reqs:
        row = batch.req_id_to_index[data.req_id]
        batch.num_computed_tokens_cpu[row] = data.num_computed_tokens
        batch.append_block_ids(row, data.new_block_ids)


def test_prepare_inputs_matches_seed_example():
    kv = KVCacheManager(num_blocks=16, block_size=2)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10, max_model_len=M), kv)
    prompts = [[T(0, i) for i in range(3)], [T(1, i) for i in range(2)], [T(2, i) for i in range(8)]]
    for r, p in enumerate(prompts):
        sched.add_request(Request(str(r), p, SamplingParams(max_tokens=5), eos_token_id=None))
    batch = InputBatch(max_num_reqs=8, max_model_len=M, block_size=2)
    states = {}

    # ---------------- step 1
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"0": 3, "1": 2, "2": 5}
    _apply(batch, so, states)
    x = batch.prepare_inputs(so.num_scheduled_tokens)
    assert x.request_indices.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2, 2]
    assert x.positions.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4]
    assert x.token_indices.tolist() == [0, 1, 2, 12, 13, 24, 25, 26, 27, 28]
    assert x.input_ids.tolist() == [
        T(0, 0),
        T(0, 1),
        T(0, 2),
        T(1, 0),
        T(1, 1),
        T(2, 0),
        T(2, 1),
        T(2, 2),
        T(2, 3),
        T(2, 4),
    ]
    assert batch.block_table[:4].tolist() == [
        [1, 2, 0, 0, 0, 0],
        [3, 0, 0, 0, 0, 0],
        [4, 5, 6, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],
    ]
    assert x.block_table_indices.tolist() == [0, 0, 1, 6, 6, 12, 12, 13, 13, 14]
    assert x.block_numbers.tolist() == [1, 1, 2, 3, 3, 4, 4, 5, 5, 6]
    assert x.block_offsets.tolist() == [0, 1, 0, 0, 1, 0, 1, 0, 1, 0]
    assert x.slot_mapping.tolist() == [2, 3, 4, 6, 7, 8, 9, 10, 11, 12]
    assert x.query_start_loc.tolist() == [0, 3, 5, 10]
    assert x.seq_lens.tolist() == [3, 2, 5]
    assert x.num_computed_tokens.tolist() == [0, 0, 0]
    assert len(x.req_ids) == 3
    assert x.num_scheduled_tokens.tolist() == [3, 2, 5]
    assert x.max_query_len == 5
    # Requests 0 and 1 finished their prompts and sample; request 2 is mid-prefill.
    assert x.sample_rows.tolist() == [0, 1]
    assert x.logits_indices.tolist() == [2, 4]

    # The runner samples T_0_3 and T_1_2 and writes them into its token-id table.
    batch.append_token(0, T(0, 3))
    batch.append_token(1, T(1, 2))
    outs = sched.update_from_output(so, ModelRunnerOutput(["0", "1", "2"], [[T(0, 3)], [T(1, 2)], []]))
    assert [o.req_id for o in outs] == ["0", "1"]

    # ---------------- step 2
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"0": 1, "1": 1, "2": 3}
    _apply(batch, so, states)
    x = batch.prepare_inputs(so.num_scheduled_tokens)
    assert x.request_indices.tolist() == [0, 1, 2, 2, 2]
    assert x.positions.tolist() == [3, 2, 5, 6, 7]
    assert batch.token_ids_cpu[0, :4].tolist() == [T(0, 0), T(0, 1), T(0, 2), T(0, 3)]
    assert batch.token_ids_cpu[1, :3].tolist() == [T(1, 0), T(1, 1), T(1, 2)]
    assert x.token_indices.tolist() == [3, 14, 29, 30, 31]
    assert x.input_ids.tolist() == [T(0, 3), T(1, 2), T(2, 5), T(2, 6), T(2, 7)]
    assert batch.block_table[:4].tolist() == [
        [1, 2, 0, 0, 0, 0],
        [3, 7, 0, 0, 0, 0],
        [4, 5, 6, 8, 0, 0],
        [0, 0, 0, 0, 0, 0],
    ]
    assert x.block_table_indices.tolist() == [1, 7, 14, 15, 15]
    assert x.block_numbers.tolist() == [2, 7, 6, 8, 8]
    assert x.block_offsets.tolist() == [1, 0, 1, 0, 1]
    assert x.slot_mapping.tolist() == [5, 14, 13, 16, 17]
    assert x.query_start_loc.tolist() == [0, 1, 2, 5]
    assert x.seq_lens.tolist() == [4, 3, 8]
    assert x.num_computed_tokens.tolist() == [3, 2, 5]
    assert x.max_query_len == 3
    assert x.max_seq_len == 8  # the 5 x 8 attention mask of the seed
    assert x.sample_rows.tolist() == [0, 1, 2]
    assert np.array_equal(x.logits_indices.numpy(), [0, 1, 4])
