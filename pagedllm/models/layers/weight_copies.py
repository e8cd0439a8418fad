"""Whether the CPU's float linears hold a second copy of their weights.

CPUPackedLinearMethod keeps, beside oneDNN's packed weight, the weight for its few-row kernel (the
plain weight for linear_small, or the bfloat16 pair layout), and CPUBf16PairLinearMethod the
plain weight beside the pair layout: twice the weight memory, for decode steps up to 1.5x faster.
A model that fits once but not twice did not load: a 3B Llama in float32 (12.8 GB of weights) on a
24 GiB machine was killed for memory at 24.2 GB, and holds 14.4 GB with one copy (an 8B one in
bfloat16, ~16 GB, likewise by the arithmetic). So after the weights are loaded, the second
copies are made only if they fit in the memory then available (MemAvailable, or a container's
cgroup limit where lower) with RESERVE left over (the KV cache, 4 GiB by default, and the steps'
activations); otherwise each of those linears holds one copy and computes every row count with
it (oneDNN's packed linear; the pair kernel where oneDNN has no bf16 kernels).
PAGEDLLM_CPU_WEIGHT_COPIES=1 / 2 forces one / two copies.
"""

from __future__ import annotations

import logging
from typing import Optional

from pagedllm import envs

logger = logging.getLogger(__name__)

RESERVE = 6 << 30  # bytes left after the second copies: the default KV cache and the activations


# A container's memory limit and use: cgroup v2's files, then v1's (under the cgroup root).
CGROUP_FILES = (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"))


def cgroup_room(root: str = "/sys/fs/cgroup") -> Optional[int]:
    """Bytes the process's memory cgroup still allows (its limit less its use, page cache
    included), or None where there is no limit."""
    for limit_file, used_file in CGROUP_FILES:
        try:
            with open(f"{root}/{limit_file}") as f:
                limit = f.read().strip()
            with open(f"{root}/{used_file}") as f:
                used = int(f.read())
        except (OSError, ValueError):
            continue
        if limit != "max" and int(limit) < 1 << 60:  # v1 writes "no limit" as ~2^63
            return max(0, int(limit) - used)
    return None


def available_memory() -> Optional[int]:
    """The smaller of MemAvailable (/proc/meminfo) and the cgroup's room, in bytes; None where
    neither is known."""
    known = [] if (room := cgroup_room()) is None else [room]
    try:
        with open("/proc/meminfo") as f:
            known += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except OSError:
        pass
    return min(known) if known else None


def second_copies_fit(extra: int, available: Optional[int]) -> bool:
    """Whether `extra` bytes of second copies leave RESERVE of `available` (unknown: they fit)."""
    return available is None or extra + RESERVE <= available


def choose_weight_copies(methods) -> None:
    """methods: (layer, method) pairs of a loaded model, before process_weights_after_loading.
    Sets `one_copy` on each method that has it, by PAGEDLLM_CPU_WEIGHT_COPIES (auto: by memory)."""
    methods = [(layer, m) for layer, m in methods if hasattr(m, "one_copy")]
    if not methods:
        return
    mode = envs.PAGEDLLM_CPU_WEIGHT_COPIES
    extra = sum(m.second_copy_bytes(layer) for layer, m in methods)
    if mode == "auto":
        available = available_memory()
        one = not second_copies_fit(extra, available)
        if one:
            logger.warning(
                "one copy of each linear's weights: a second (%.1f GB) does not fit in the %.1f GB "
                "available with %.1f GB left for the KV cache and activations (decode steps of "
                "few rows are slower; PAGEDLLM_CPU_WEIGHT_COPIES=2 forces it)",
                extra / 1e9,
                available / 1e9,
                RESERVE / 1e9,
            )
    else:
        one = mode == "1"
    for _, m in methods:
        m.one_copy = one
