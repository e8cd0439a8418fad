"""glibc's malloc kept from handing a CPU step's activations back to the kernel after each op.

torch allocates every op's output with malloc. glibc serves a block over its mmap threshold
(128 KiB at start, raised adaptively up to the size of the largest freed one) with a fresh
mmap and unmaps it when freed, and trims the heap's free top past its trim threshold; the next
op's output then takes a page fault, and the kernel zeroes the page, for every 4 KiB it writes.
A 2,048-token prefill step of SmolLM2-135M allocates ~1 GB of such outputs (the gate_up
output alone is 12.6 MB a layer) and took 70-110 k page faults, 0.15-0.4 s of system time
against 2.5 s of compute at one thread. vLLM's CPU guide preloads tcmalloc for the same
reason.

Fixed thresholds instead (mallopt, which also ends the adaptive raising): every block comes
from the heap and stays mapped when freed, and up to 1 GiB of free heap top stays mapped, so a
step reuses the pages of the one before. glibc's mmap threshold stops at 32 MiB, so blocks above
it (a 1B model's 2,048-row gate_up output is 64 MiB, its SiLU output 32) would still take fresh
mappings, ~400 k page faults a prefill step; no mmap at all (M_MMAP_MAX 0) serves them from the
heap too (glibc still maps a block where the heap cannot grow). Only the process's first call
acts, after the weights are loaded (Worker.load_model): the loader's freed buffers are handed
back first (malloc_trim), and a repacked weight takes a mapping of its own
(models/layers/quantization/weight_pages.py). PAGEDLLM_CPU_MALLOC_KEEP=0 leaves glibc's
defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

from pagedllm import envs

logger = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 1 << 30

_applied: list[bool] = []  # the first call's outcome


def keep_freed_memory() -> bool:
    """Set glibc's thresholds for this process (see above) -> whether they are set: False
    off glibc (another libc, macOS) or with PAGEDLLM_CPU_MALLOC_KEEP=0."""
    if not _applied:
        _applied.append(_set_thresholds())
    return _applied[0]


def _set_thresholds() -> bool:
    if not envs.PAGEDLLM_CPU_MALLOC_KEEP or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc only: musl's mallopt does nothing
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    libc.malloc_trim(0)  # first hand back what the loader freed (the raw weight blocks)
    ok = (
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
        and mallopt(M_MMAP_MAX, 0) == 1
        and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    )
    if not ok:
        logger.warning("glibc's mallopt refused the CPU step's malloc thresholds; the step pays page faults")
    return ok
