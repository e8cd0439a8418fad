"""Repacked GGUF weights in mappings of their own (models/layers/quantization/weight_pages.py),
checked against the kernel's own account of the process's mappings (/proc/self/smaps)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from pagedllm.models.layers.quantization.gguf_repack import pack_segments
from pagedllm.models.layers.quantization.weight_pages import HUGE_PAGE, mapped_bytes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")
THP = os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")  # a kernel with huge pages takes the advice


def _mapping_of(address: int) -> tuple[int, int, str, set[str]]:
    """(start, end, path, VmFlags) of the mapping in /proc/self/smaps that holds `address`."""
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                start, end = (int(v, 16) for v in head[0].split("-"))
                found = (start, end, head[5] if len(head) > 5 else "") if start <= address < end else None
            elif found and head[0] == "VmFlags:":
                return (*found, set(head[1:]))
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("n", [1, 4096 * 3 + 7, 3 * HUGE_PAGE + 12345])
def test_mapped_bytes_own_aligned_private_mapping(n):
    """Starts on a 2 MiB boundary inside an anonymous private mapping (no path), huge pages
    advised for its whole 2 MiB pages and refused for the tail; every byte writable. (The mapping's size is not checked: the kernel merges
    neighbouring anonymous mappings of the same flags into one, e.g. two weights'.)"""
    a = mapped_bytes(n)
    assert a.dtype == np.uint8 and a.shape == (n,)
    address = a.ctypes.data
    assert address % HUGE_PAGE == 0
    start, end, path, flags = _mapping_of(address)
    assert path == "" and "mr" in flags and "ms" not in flags  # anonymous, private (not shared)
    full = n // HUGE_PAGE * HUGE_PAGE
    if full:
        assert address + full <= end and ("hg" in flags or not THP)  # MADV_HUGEPAGE
        start, end, path, flags = _mapping_of(address + full)
    assert address + n <= end and ("nh" in flags or not THP)  # MADV_NOHUGEPAGE: the tail
    a[:] = 7
    assert int(a.sum()) == 7 * n


def test_packed_weight_on_a_huge_page_boundary():
    """pack_segments' bytes (what the linears read; their values: test_quantization's repack
    tests) are 2 MiB-aligned in an anonymous mapping whatever malloc's state (a weight under
    2 MiB: its tail, no huge page)."""
    rows = np.random.default_rng(0).integers(0, 256, size=(40, 2 * 34), dtype=np.uint8)  # Q8_0, K = 64
    packed, _ = pack_segments([("Q8_0", rows)], "int8")
    assert packed.numel() == 48 * 2 * 34  # 40 rows padded to 3 groups of 16
    start, end, path, flags = _mapping_of(packed.data_ptr())
    assert packed.data_ptr() % HUGE_PAGE == 0 and path == "" and ("nh" in flags or not THP)
    assert packed.data_ptr() + packed.numel() <= end


def test_mapped_bytes_refuses_a_negative_size():
    with pytest.raises(ValueError, match="n must be >= 0"):
        mapped_bytes(-1)
