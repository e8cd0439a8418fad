"""open_gguf (models/gguf/reader.py): the gguf package's reader over a plain view of the file
reads what the package's own GGUFReader reads, field for field and tensor for tensor."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm.models.gguf.reader import open_gguf


@pytest.mark.model
def test_open_gguf_reads_what_gguf_reader_reads():
    from gguf import GGUFReader

    from pagedllm.models.download import find_gguf

    path = find_gguf()  # the default model's Q4_1 file: a 49,152-token vocabulary, a chat template
    ref, ours = GGUFReader(str(path)), open_gguf(path)
    assert type(ours.data) is np.ndarray and isinstance(ref.data, np.memmap)
    assert list(ours.fields) == list(ref.fields)
    for name, f in ref.fields.items():
        g = ours.fields[name]
        assert (g.offset, g.types, g.data) == (f.offset, f.types, f.data), name
        assert g.contents() == f.contents(), name
    assert ours.data_offset == ref.data_offset and ours.alignment == ref.alignment
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in ref.tensors
    ]
    for t, r in zip(ours.tensors, ref.tensors):
        assert type(t.data) is np.ndarray and not t.data.flags.writeable
        assert np.array_equal(t.data, r.data), t.name


def test_open_gguf_refuses_a_file_that_is_not_gguf(tmp_path):
    bad = tmp_path / "not.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="GGUF magic invalid"):
        open_gguf(bad)
