"""One copy of each CPU float linear's weights where two do not fit (models/layers/weight_copies.py):
the decision from the memory available after loading, and the weights then held once (the greedy
tokens with one copy: tests/engine/test_greedy_equality.py)."""

import pytest

from pagedllm import LLM
from pagedllm.models.layers import weight_copies
from pagedllm.models.layers.cpu_packed_linear import CPUPackedLinearMethod
from pagedllm.models.layers.quantization.layouts import weight_bytes


def test_second_copies_fit_leaves_the_reserve():
    r = weight_copies.RESERVE
    assert weight_copies.second_copies_fit(10, r + 10)
    assert not weight_copies.second_copies_fit(11, r + 10)
    assert weight_copies.second_copies_fit(1 << 40, None)  # no /proc/meminfo: as before, two copies
    assert weight_copies.available_memory() is None or weight_copies.available_memory() > 0


@pytest.mark.parametrize("v2", [True, False])
def test_cgroup_room_reads_the_limit(tmp_path, v2):
    """A container's memory limit (cgroup v2's memory.max / memory.current, or v1's files) bounds
    the memory available; no limit ("max", v1's ~2^63) or no files: None."""
    limit, used = weight_copies.CGROUP_FILES[0 if v2 else 1]
    (tmp_path / "memory").mkdir()
    assert weight_copies.cgroup_room(str(tmp_path)) is None
    (tmp_path / used).write_text("3000\n")
    (tmp_path / limit).write_text("10000\n")
    assert weight_copies.cgroup_room(str(tmp_path)) == 7000
    (tmp_path / limit).write_text("max\n" if v2 else "9223372036854771712\n")
    assert weight_copies.cgroup_room(str(tmp_path)) is None


def _runner(llm):
    return llm.llm_engine.core.model_executor.driver_worker.model_runner


def _methods(model):
    return [
        (m, m.linear_method)
        for m in model.modules()
        if isinstance(getattr(m, "linear_method", None), CPUPackedLinearMethod)
    ]


@pytest.mark.model
def test_auto_holds_one_copy_where_two_do_not_fit(model_dir, hf_model, monkeypatch):
    """auto: with the memory available after loading below the second copies plus the reserve,
    every packed linear holds oneDNN's weight alone (no plain or pair copy: the model's weights
    then take the checkpoint's parameters' bytes, and the tied LM head's packed table beside the
    embedding's, which looks its rows up in the plain one); with room, the few-row copies are kept
    (about twice those bytes)."""
    params = sum(p.numel() * p.element_size() for p in hf_model.parameters())  # float32, tied once
    table = hf_model.get_input_embeddings().weight
    assert hf_model.config.tie_word_embeddings
    params += table.numel() * table.element_size()
    monkeypatch.setenv("PAGEDLLM_CPU_WEIGHT_COPIES", "auto")
    held = {}
    for room, one in ((weight_copies.RESERVE + (1 << 20), True), (64 << 30, False)):
        monkeypatch.setattr(weight_copies, "available_memory", lambda room=room: room)
        llm = LLM(model_dir, max_model_len=256, kv_cache_memory=1 << 26)
        model = _runner(llm).model
        methods = _methods(model)
        assert methods and all(m.one_copy is one for _, m in methods)
        if one:
            assert all(layer.weight is None and m.small_rows == 0 for layer, m in methods)
        held[one] = weight_bytes(model)
        del llm, model, methods
    print(
        f"weights held: one copy {held[True] / 1e6:.1f} MB, two {held[False] / 1e6:.1f} MB, parameters {params / 1e6:.1f} MB"
    )
    assert held[True] <= 1.01 * params
    assert held[False] >= 1.5 * params
