"""How much GPU memory the KV cache gets: profile one forward at start-up, give it the rest.

    budget = total * gpu_memory_utilization - weights - peak activations - non-torch memory

Every part is a delta between snapshots of the device (vLLM's baseline snapshot), so memory
that was in use before this engine started (a second engine in the same process, as in a
notebook; another process on the GPU) is never counted as this engine's:
- weights: what loading the model added to torch's allocated memory (snapshot before / after
  ``load_model``, taken by the runner);
- peak activations: torch's peak allocation during a dummy step of max_num_batched_tokens
  tokens spread over up to max_num_seqs requests, with logits and a top-p sampling pass for
  every request (the widest step the scheduler can build), above what was allocated before it;
- non-torch memory: what the device reports in use beyond torch's reserve (the CUDA context's
  growth, cuBLAS workspaces, NCCL, loaded kernels), less the same figure at the baseline.
The engine's share (total * gpu_memory_utilization) must be free at the baseline: else a
ValueError says how much others hold.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GiB = 2**30


@dataclass(frozen=True)
class MemorySnapshot:
    """One reading of a CUDA device's memory, in bytes."""

    total: int  # the device's memory
    free: int  # free on the device (every process counted)
    torch_allocated: int  # this process's live torch tensors on it
    torch_reserved: int  # what torch's caching allocator holds (allocated + cached)
    torch_peak: int = 0  # torch's peak allocation since its last reset_peak_memory_stats

    @property
    def non_torch(self) -> int:
        """In use on the device but not by torch's allocator here: the CUDA context, NCCL,
        other processes."""
        return max(0, self.total - self.free - self.torch_reserved)

    @classmethod
    def take(cls, device) -> Optional["MemorySnapshot"]:
        """The device's snapshot now; None off CUDA."""
        device = torch.device(device)
        if device.type != "cuda":
            return None
        free, total = torch.cuda.mem_get_info(device)
        return cls(
            total=total,
            free=free,
            torch_allocated=torch.cuda.memory_allocated(device),
            torch_reserved=torch.cuda.memory_reserved(device),
            torch_peak=torch.cuda.max_memory_allocated(device),
        )


@dataclass(frozen=True)
class MemoryProfile:
    """What the engine's share of the device goes to, in bytes (see the module docstring)."""

    requested: int  # total * gpu_memory_utilization
    in_use_before: int  # the device's use at the baseline (others', and the CUDA context)
    weights: int
    peak_activation: int
    non_torch: int  # non-torch memory this engine added
    kv_cache: int  # the budget left for the KV cache


def profile_by_delta(
    baseline: MemorySnapshot,
    after_load: MemorySnapshot,
    before_step: MemorySnapshot,
    after_step: MemorySnapshot,
    utilization: float,
) -> MemoryProfile:
    """The memory profile from four snapshots: at the baseline (before the weights load),
    after loading, before the dummy step (its temporary KV cache allocated) and after it (its
    torch_peak since a reset before the step, then the allocator's cache emptied). A
    ValueError when the engine's share was not free at the baseline, or leaves nothing for
    the KV cache."""
    requested = int(baseline.total * utilization)
    in_use = baseline.total - baseline.free
    if requested > baseline.free:
        raise ValueError(
            f"gpu_memory_utilization {utilization} asks for {requested / GiB:.2f} GiB of the device's "
            f"{baseline.total / GiB:.2f} GiB, but only {baseline.free / GiB:.2f} GiB are free: "
            f"{in_use / GiB:.2f} GiB are in use by other engines or processes (torch in this process: "
            f"{baseline.torch_reserved / GiB:.2f} GiB). Lower gpu_memory_utilization, or free the device"
        )
    weights = after_load.torch_allocated - baseline.torch_allocated
    peak = max(0, after_step.torch_peak - before_step.torch_allocated)
    non_torch = max(0, after_step.non_torch - baseline.non_torch)
    budget = kv_cache_budget(baseline.total, utilization, weights, peak, non_torch)
    return MemoryProfile(requested, in_use, weights, peak, non_torch, budget)


def kv_cache_budget(total: int, utilization: float, weights: int, peak_activation: int, non_torch: int) -> int:
    """Bytes left for the KV cache; a ValueError naming what to change when none are."""
    budget = int(total * utilization) - weights - peak_activation - non_torch
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization {utilization} allows {total * utilization / GiB:.2f} GiB of "
            f"the device's {total / GiB:.2f} GiB, but the weights take {weights / GiB:.2f} GiB, "
            f"the peak activations {peak_activation / GiB:.2f} GiB and other memory "
            f"{non_torch / GiB:.2f} GiB: nothing is left for the KV cache. Raise "
            "gpu_memory_utilization, or lower max_num_batched_tokens / max_num_seqs"
        )
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
    req = np.repeat(np.arange(num_reqs), q_lens)  # [T]
    positions = np.arange(num_tokens) - qsl[:-1][req]  # [T] offset in its request
    slots = block_table[req, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return qsl, q_lens.astype(np.int32), block_table, slots, positions.astype(np.int64), 1 + num_reqs * nb


@torch.inference_mode()
def profile_kv_cache_memory(runner) -> int:
    """Run the dummy step on runner's GPU; return the KV cache budget in bytes, log each part
    and keep them as ``runner.memory_profile`` (runner.memory_baseline / memory_after_load:
    the snapshots the runner took around loading the weights)."""
    from pagedllm.forward_context import set_forward_context
    from pagedllm.worker.sampler import SamplingMetadata

    sc = runner.config.scheduler_config
    util = runner.config.device_config.gpu_memory_utilization
    T = min(sc.max_num_batched_tokens, sc.max_num_seqs * runner.max_model_len)
    R = min(sc.max_num_seqs, T)
    qsl, seq_lens, block_table, slots, positions, num_blocks = dummy_step_layout(T, R, runner.block_size)
    dev = runner.device
    torch.cuda.empty_cache()
    # A temporary cache just big enough for the dummy requests (its size is not activation).
    runner.kv_caches = runner.alloc_kv_caches(num_blocks, dev)
    runner.bind_kv_caches(runner.kv_caches)
    torch.cuda.reset_peak_memory_stats(dev)
    before_step = MemorySnapshot.take(dev)
    meta = runner.attn_backend.build_metadata(
        torch.from_numpy(qsl),
        torch.from_numpy(seq_lens),
        torch.from_numpy(block_table),
        torch.from_numpy(slots),
        runner.block_size,
        int(np.diff(qsl).max()),
        int(seq_lens.max()),
    )
    input_ids = torch.zeros(T, dtype=torch.int64, device=runner.device)
    with set_forward_context(meta):
        hidden = runner.model(input_ids, torch.from_numpy(positions).to(runner.device))
    logits = runner.model.compute_logits(hidden[torch.from_numpy(qsl[1:] - 1).to(runner.device)])
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50)] * R
    md = SamplingMetadata.build(
        params, [[0]] * R, [[]] * R, [None] * R, [set()] * R, runner.vocab_size, device=runner.device
    )
    runner.sampler(logits, md)
    torch.cuda.synchronize(dev)
    del hidden, logits
    runner.kv_caches = []
    runner.bind_kv_caches([])  # the layers let go of the temporary cache too
    torch.cuda.empty_cache()
    after_step = MemorySnapshot.take(dev)  # its torch_peak: the step's (since the reset)
    prof = profile_by_delta(runner.memory_baseline, runner.memory_after_load, before_step, after_step, util)
    runner.memory_profile = prof
    logger.info(
        "memory profile (%d tokens, %d requests): device %.2f GiB x %.2f = %.2f GiB; in use "
        "before this engine %.2f GiB (not counted); weights %.2f GiB, peak activations %.2f "
        "GiB, non-torch added %.2f GiB -> KV cache %.2f GiB",
        T,
        R,
        after_step.total / GiB,
        util,
        prof.requested / GiB,
        prof.in_use_before / GiB,
        prof.weights / GiB,
        prof.peak_activation / GiB,
        prof.non_torch / GiB,
        prof.kv_cache / GiB,
    )
    return prof.kv_cache
