"""PinnedStaging without a GPU: `upload` hands the sources over as tensors (nothing to copy on the
CPU), and the staged copies alternate between the two buffer sets (so a step's copies never
overwrite the previous step's, which may still be queued on a GPU's stream)."""

import numpy as np
import torch

from pagedllm.worker.pinned_staging import PinnedStaging

CPU = torch.device("cpu")


def test_upload_on_the_cpu_returns_the_sources():
    st = PinnedStaging({"a": ((8,), torch.int64), "b": ((8,), torch.int64)}, CPU)
    a = np.array([3, 1, 2], dtype=np.int64)
    b = torch.tensor([7, 9])
    ta, tb = st.upload(a=a, b=b)
    assert tb is b
    a[0] = 5  # the same memory: no copy was made
    assert ta.tolist() == [5, 1, 2]


def test_staged_copies_alternate_between_the_two_sets():
    st = PinnedStaging({"a": ((4,), torch.int64)}, CPU)
    st.begin()
    first = st.to_device("a", np.array([1, 2], dtype=np.int64), CPU)
    st.end()
    st.begin()
    second = st.to_device("a", np.array([3, 4, 5], dtype=np.int64), CPU)
    st.end()
    assert first.tolist() == [1, 2] and second.tolist() == [3, 4, 5]
    assert first.data_ptr() != second.data_ptr()
    st.begin()  # the first set again, refilled
    third = st.to_device("a", np.array([6], dtype=np.int64), CPU)
    assert third.data_ptr() == first.data_ptr() and first.tolist() == [6, 2]
