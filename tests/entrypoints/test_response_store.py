"""The Responses store's bounds: the oldest entry goes past max_entries, an entry past its time
is a 404 (the clock is set by hand), a deleted one too, and bad sizes are refused."""

import pytest

from pagedllm.entrypoints.openai import response_store
from pagedllm.entrypoints.openai.response_store import ResponseStore
from pagedllm.entrypoints.openai.serving_engine import OpenAIError


def _missing(store, rid):
    with pytest.raises(OpenAIError) as e:
        store.get(rid)
    assert e.value.status == 404 and rid in e.value.message


def test_bounded_expiring_deletable(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(response_store.time, "monotonic", lambda: now[0])
    store = ResponseStore(max_entries=2, ttl_s=10)
    for i in range(3):
        store.put({"id": f"r{i}"}, [{"role": "user", "content": str(i)}])
    _missing(store, "r0")  # the oldest went
    assert store.get("r2") == ({"id": "r2"}, [{"role": "user", "content": "2"}])
    store.delete("r1")
    _missing(store, "r1")
    now[0] = 110.5  # past r2's 10 s
    _missing(store, "r2")


@pytest.mark.parametrize("size, ttl", [(0, 10), (4, 0)])
def test_bad_bounds(size, ttl):
    with pytest.raises(ValueError, match="max_entries"):
        ResponseStore(size, ttl)
