"""A repacked weight in its own anonymous mapping, 2 MiB-aligned, with transparent huge pages
advised.

numpy advises huge pages (madvise MADV_HUGEPAGE) for every array of 4 MiB or more, but only
pages not yet touched become huge. Under glibc's default thresholds a weight-sized array was a
fresh mmap and got them; with a CPU worker's fixed thresholds (worker/cpu_malloc.py) arrays up
to 32 MiB come from the heap, often from the holes that freed load-time buffers (the raw GGUF
blocks of the layer before) left, whose pages are already faulted in as 4 KiB ones: a 1B Q8_0
model then held ~220 MB fewer of its weights on huge pages. Each weight its own mapping keeps
its placement independent of malloc's state: page-aligned (so 64-byte aligned for the
kernels' loads), starting on a huge-page boundary, and freed back to the kernel with it.
"""

from __future__ import annotations

import mmap

import numpy as np

HUGE_PAGE = 2 << 20


def mapped_bytes(n: int) -> np.ndarray:
    """A uint8 array [n] in a private anonymous mapping of its own whose first byte is 2 MiB-
    aligned; huge pages advised for its whole 2 MiB pages where the OS has the call, not for
    the rest (the mapping lives as long as the array or a tensor made from it)."""
    if n < 0:
        raise ValueError(f"mapped_bytes: n must be >= 0, not {n}")
    # One huge page of slack ahead: anonymous mappings are only page-aligned in general.
    m = mmap.mmap(-1, n + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(m, dtype=np.uint8)  # holds m
    start = -whole.ctypes.data % HUGE_PAGE
    # Huge pages for the whole 2 MiB pages of the weight only: its tail on 4 KiB pages, or the
    # tail's huge page would hold up to 2 MiB the weight does not use.
    full = n // HUGE_PAGE * HUGE_PAGE
    if hasattr(m, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            if full:
                m.madvise(mmap.MADV_HUGEPAGE, start, full)
            m.madvise(mmap.MADV_NOHUGEPAGE, start + full, len(m) - start - full)
        except OSError:  # a kernel built without transparent huge pages: EINVAL
            pass
    return whole[start : start + n]
