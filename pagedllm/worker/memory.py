"""How much GPU memory the KV cache gets: profile one forward at start-up, give it the rest.

    budget = total * gpu_memory_utilization - weights - peak activations - non-torch memory

Peak activations come from a dummy step of max_num_batched_tokens tokens spread over up to
max_num_seqs requests, with logits and a top-p sampling pass for every request (the widest
step the scheduler can build). Non-torch memory is what the device has in use that torch's
allocator did not reserve: the CUDA context, NCCL, other processes.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GiB = 2**30


def kv_cache_budget(total: int, utilization: float, weights: int, peak_activation: int,
                    non_torch: int) -> int:
    """Bytes left for the KV cache; a ValueError naming what to change when none are."""
    budget = int(total * utilization) - weights - peak_activation - non_torch
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization {utilization} allows {total * utilization / GiB:.2f} GiB of "
            f"the device's {total / GiB:.2f} GiB, but the weights take {weights / GiB:.2f} GiB, "
            f"the peak activations {peak_activation / GiB:.2f} GiB and other memory "
            f"{non_torch / GiB:.2f} GiB: nothing is left for the KV cache. Raise "
            "gpu_memory_utilization, or lower max_num_batched_tokens / max_num_seqs")
    return budget


def dummy_step_layout(num_tokens: int, num_reqs: int, block_size: int):
    """A prefill-only step of num_tokens tokens over num_reqs requests, each in blocks of its
    own after the null block -> (query_start_loc [R+1] int32, seq_lens [R] int32,
    block_table [R, nb] int32, slot_mapping [T] int64, positions [T] int64, num_blocks)."""
    q_lens = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int64)
    q_lens[: num_tokens % num_reqs] += 1
    qsl = np.zeros(num_reqs + 1, dtype=np.int32)
    qsl[1:] = np.cumsum(q_lens)
    nb = -(int(q_lens.max()) // -block_size)
    block_table = (1 + np.arange(num_reqs)[:, None] * nb + np.arange(nb)).astype(np.int32)
    req = np.repeat(np.arange(num_reqs), q_lens)                 # [T]
    positions = np.arange(num_tokens) - qsl[:-1][req]            # [T] offset in its request
    slots = block_table[req, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return qsl, q_lens.astype(np.int32), block_table, slots, positions.astype(np.int64), 1 + num_reqs * nb


@torch.inference_mode()
def profile_kv_cache_memory(runner) -> int:
    """Run the dummy step on runner's GPU; return the KV cache budget in bytes and log it."""
    from pagedllm.attention.layer import bind_kv_cache
    from pagedllm.forward_context import set_forward_context
    from pagedllm.worker.sampler import SamplingMetadata
    sc = runner.config.scheduler_config
    util = runner.config.device_config.gpu_memory_utilization
    T = min(sc.max_num_batched_tokens, sc.max_num_seqs * runner.max_model_len)
    R = min(sc.max_num_seqs, T)
    qsl, seq_lens, block_table, slots, positions, num_blocks = dummy_step_layout(T, R, runner.block_size)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    weights = torch.cuda.memory_allocated()
    # A temporary cache just big enough for the dummy requests (its size is not activation).
    runner.kv_caches = runner.alloc_kv_caches(num_blocks, runner.device)
    bind_kv_cache(runner.model, runner.kv_caches)
    cache_bytes = torch.cuda.memory_allocated() - weights
    meta = runner.attn_backend.build_metadata(
        torch.from_numpy(qsl), torch.from_numpy(seq_lens), torch.from_numpy(block_table),
        torch.from_numpy(slots), runner.block_size, int(np.diff(qsl).max()), int(seq_lens.max()))
    input_ids = torch.zeros(T, dtype=torch.int64, device=runner.device)
    with set_forward_context(meta):
        hidden = runner.model(input_ids, torch.from_numpy(positions).to(runner.device))
    logits = runner.model.compute_logits(hidden[torch.from_numpy(qsl[1:] - 1).to(runner.device)])
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50)] * R
    md = SamplingMetadata.build(params, [[0]] * R, [[]] * R, [None] * R, [set()] * R,
                                runner.vocab_size, device=runner.device)
    runner.sampler(logits, md)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - weights - cache_bytes
    del hidden, logits
    runner.kv_caches = []
    bind_kv_cache(runner.model, [])   # the layers let go of the temporary cache too
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved())
    budget = kv_cache_budget(total, util, weights, peak, non_torch)
    logger.info("memory profile (%d tokens, %d requests): device %.2f GiB x %.2f, weights %.2f GiB, "
                "peak activations %.2f GiB, non-torch %.2f GiB -> KV cache %.2f GiB",
                T, R, total / GiB, util, weights / GiB, peak / GiB, non_torch / GiB, budget / GiB)
    return budget
