"""Tensor parallelism over a GGUF file held in its blocks (models/gguf/tp_split.py): greedy output
at TP=2 (two Gloo processes, each holding its rows of the column-parallel matrices and its
blocks of each row of o_proj / down_proj) equals TP=1 on the same make-gguf file token for
token; a row's blocks cut at a boundary dequantise as the gguf package's whole row does, and
two row-parallel halves of a layer sum to the whole layer (every kernel build); a file
whose row-parallel split would cut a block is refused before any process starts, naming the
tensor, its type and the sizes.

The reference is TP=1 with the top-2 logprobs: where the two first differ, a numerical tie
(greedy_utils.TIE_EPS) ends that sequence's comparison; any other difference is a bug."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from tests.greedy_utils import assert_greedy_equal

MAX_TOKENS = 16
PROMPTS = [[5 + i, (37 * i) % 400 + 3, 100 + 7 * i, 250, 11 * i + 1, 60, 61 + i] for i in range(6)]


@pytest.fixture(autouse=True)
def one_thread_per_worker(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDLLM_WORKER_THREADS", "1")
    monkeypatch.setenv("PAGEDLLM_HOME", str(tmp_path / "home"))


def _make_gguf(shape: str, file_type: str, out):
    from pagedllm.models.gguf.cli import cmd_make_gguf

    cmd_make_gguf(argparse.Namespace(shape=shape, type=file_type, seed=0, out=str(out)))
    return out


def _tensor_types(path) -> dict:
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}


def _generate(path, tp: int, logprobs=None):
    from pagedllm import LLM, SamplingParams

    llm = LLM(
        str(path),
        tensor_parallel_size=tp,
        max_model_len=64,
        enable_prefix_caching=False,
        max_num_seqs=4,
        kv_cache_memory=2**25,
    )
    try:
        if tp > 1:
            assert llm.llm_engine.core.model_executor.world_size == tp
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs)
        return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "shape,file_type,row_parallel_types",
    [
        ("tiny", "Q4_0", {"Q4_0"}),  # o_proj: 64 features a rank, 2 blocks of 32
        ("tiny-superblocks", "Q4_K_M", {"Q4_K", "Q6_K"}),  # uneven heads: 256 / 512 features, whole super-blocks
        ("tiny-superblocks", "Q8_0", {"Q8_0"}),
    ],
)
def test_tp2_equals_tp1(shape, file_type, row_parallel_types, tmp_path, monkeypatch):
    # int16 activations: with the int8 default, the all-reduce's other order of float sums moves
    # a later layer's int8 rounding by a whole step (1/127 of a block's range), so TP=1 and
    # TP=2 part at gaps wider than a tie; which bytes each rank reads is the same either way.
    monkeypatch.setenv("PAGEDLLM_GGUF_ACTIVATIONS", "int16")
    path = _make_gguf(shape, file_type, tmp_path / f"{shape}-{file_type}.gguf")
    types = _tensor_types(path)
    assert {t for n, t in types.items() if ".attn_output." in n or ".ffn_down." in n} == row_parallel_types
    ref = []
    for o in _generate(path, 1, logprobs=2):
        c = o.outputs[0]
        top2 = [sorted((lp.logprob for lp in pos.values()), reverse=True) for pos in c.logprobs]
        ref.append((list(c.token_ids), [a - b for a, b, *_ in top2]))
    assert len({t for r, _ in ref for t in r}) > 8, "a degenerate reference (a few repeated tokens) proves little"
    assert_greedy_equal(_generate(path, 2), ref, f"{shape} {file_type}: TP=2 against TP=1", max_ties=1)


def test_refused_where_a_row_parallel_split_cuts_a_block(tmp_path):
    """tiny's ffn_down rows (256 features) are one Q4_K super-block: two ranks of 128 each
    cannot hold whole blocks. Refused when the config is made, before any process or weight."""
    from pagedllm.engine.arg_utils import EngineArgs

    path = _make_gguf("tiny", "Q4_K", tmp_path / "tiny-q4_k.gguf")
    assert _tensor_types(path)["blk.0.ffn_down.weight"] == "Q4_K"
    EngineArgs(model=str(path), tensor_parallel_size=1).create_engine_config()  # one rank: served
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size 2: GGUF tensor blk\.0\.ffn_down\.weight \(Q4_K, "
        r"256 input features in blocks of 256\) would give rank 0 input "
        r"features 0\.\.127 \(128\)",
    ):
        EngineArgs(model=str(path), tensor_parallel_size=2).create_engine_config()


@pytest.mark.parametrize(
    "type_name,features",
    [("Q4_K", range(256, 768)), ("Q6_K", range(0, 256)), ("Q4_0", range(32, 96)), ("Q8_0", range(736, 768))],
)
def test_sliced_row_blobs_dequantise_as_the_whole_rows(type_name, features):
    """A rank's blocks of each row (slice_row_blobs) against the gguf package's dequantisation
    of the whole rows, cut at the same features; a cut inside a block is refused."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from pagedllm.models.gguf.tp_split import slice_row_blobs
    from pagedllm.models.gguf.writer import quantize_rows
    from pagedllm.models.layers.quantization.gguf_method import blob_width, row_blob

    w = np.random.default_rng(0).standard_normal((19, 768)).astype(np.float32)  # 19 rows: odd
    qtype = GGMLQuantizationType[type_name]
    raw = quantize_rows(w, type_name)  # [19, row bytes]
    blob = row_blob(raw, type_name, [type_name])
    part = slice_row_blobs(blob, features, blob_width([type_name], len(features)))
    assert (part[:, 0] == int(qtype)).all()
    nbytes = raw.shape[1] * len(features) // 768
    assert not part[:, 1 + nbytes :].any()  # the padding stays zero
    got = dequantize(np.ascontiguousarray(part[:, 1 : 1 + nbytes]), qtype)
    np.testing.assert_array_equal(got, dequantize(raw, qtype)[:, features.start : features.stop])
    with pytest.raises(
        ValueError, match=f"input features 16..{features.stop - 1} of a {type_name} row are not whole blocks"
    ):
        slice_row_blobs(blob, range(16, features.stop), 1 + raw.shape[1])


@pytest.mark.usefixtures("cpu_isa")  # every build of the kernels this CPU runs
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("extension", [True, False])
def test_row_parallel_halves_sum_to_the_whole_layer(type_name, extension):
    """Two RowParallelLinear ranks (no collective here: their partial products are summed by
    hand) loading the same row blobs as one whole layer: the sum is the whole layer's product
    up to float summation order, and without the extension the dequantised slices are the
    gguf package's values exactly."""
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from pagedllm.models.gguf.writer import quantize_rows
    from pagedllm.models.layers.linear import RowParallelLinear
    from pagedllm.models.layers.quantization.gguf_method import GGUFLinearMethod, row_blob

    raw = quantize_rows(np.random.default_rng(1).standard_normal((37, 512)).astype(np.float32), type_name)
    blob = torch.from_numpy(row_blob(raw, type_name, [type_name]))  # [37 outputs, 512 features]

    def layer(features: range):
        method = GGUFLinearMethod([type_name], {})
        if not extension:
            method.ops = None
        out = RowParallelLinear(features, 37, False, None, method)
        out.weight.weight_loader(out.weight, blob)
        method.process_weights_after_loading(out)
        return out

    x = torch.randn(5, 512)
    whole, halves = layer(range(512)), [layer(range(0, 256)), layer(range(256, 512))]
    split = halves[0](x[:, :256]) + halves[1](x[:, 256:])
    torch.testing.assert_close(split, whole(x), rtol=1e-5, atol=1e-4)
    if not extension:
        w = torch.from_numpy(dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float32))
        assert torch.equal(halves[1].qweight, w[:, 256:])
