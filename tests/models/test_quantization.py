"""Weight-only quantization (models/layers/quantization/, csrc/quant_ops.cpp): the kernel against
a float64 reference on the dequantised weight (odd shapes, every group size, 1-8 rows and the
tile path; the 1-8-row integer kernel against a reference on the same int16 activations, exact
integer sums, and against the float one within the activations' rounding bound); integer sums
exact; GGUF blocks repacked exactly into the engine's layouts (equal to the gguf package's own
dequantisation); the default model's GGUF file and int8 weights against float32 greedy output
on the greedy-equality prompts; bad flags are ValueErrors."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from engine.test_greedy_equality import greedy_equality_prompts
from kernel_utils import require_built

from pagedllm.models.cpu_ops import cpu_ops
from pagedllm.models.layers.quantization.registry import validate_quantization
from pagedllm.models.layers.quantization.gguf_repack import pack_segments
from pagedllm.models.layers.quantization.layouts import (
    dequantize_reference,
    pack_int4,
    quantize_int4,
    quantize_int8,
    quantize_int8_offset,
    unpack_int4,
)

ROWS = (1, 2, 3, 4, 5, 8, 9, 19, 300)  # 1-8: the register kernels; then dequantised tiles; 256+: one GEMM
CASES = [
    ("int4", 37, 96, 32),
    ("int4", 35, 256, 64),
    ("int4", 33, 384, 128),
    ("int8", 29, 77, 77),
    ("int8", 31, 64, 16),
    ("int8", 41, 160, 32),
    ("int8", 43, 192, 192),
    ("int8+offset", 39, 160, 32),
    ("int8+offset", 27, 77, 77),
]
MAX_TOKENS = 32  # greedy tokens per agreement prompt
DECODE_ROWS = 8  # the integer kernel's most rows
QBLOCK = 32  # input features per activation scale of the integer kernel
QMAX = 32767  # its activations are int16: d = amax / QMAX
INT8_ACTIVATIONS_AGREEMENT = 0.40  # GGUF with int8 activations: see test_gguf_int8_activations_greedy_agreement
HAS_AVX2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")  # the extension: -march=native


def _integer_kernel(rows, g):
    """1-8 rows with groups of a multiple of 32: the integer kernel (int16 activations)."""
    return HAS_AVX2 and rows <= 8 and g % QBLOCK == 0


def _quantized(kind, n, k, g, gen):
    w = torch.randn(n, k, generator=gen)
    if kind == "int4":
        return quantize_int4(w, g)
    if kind == "int8+offset":
        return quantize_int8_offset(w, g)
    q, s = quantize_int8(w, g)
    return q, s, torch.empty(0)


@pytest.mark.usefixtures("cpu_isa")  # every build of the kernels this CPU runs
@pytest.mark.parametrize("kind,n,k,g", CASES)
def test_quant_linear_matches_float_reference(kind, n, k, g):
    ops = require_built(cpu_ops())
    gen = torch.Generator().manual_seed(n * k)
    q, s, m = _quantized(kind, n, k, g, gen)
    w = dequantize_reference(q, s, m).double()
    bias = torch.randn(n, generator=gen)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen)
        ref = F.linear(x.double(), w, bias.double())
        out = ops.quant_linear(x, q, s, m, bias)
        if _integer_kernel(rows, g):
            _check_integer_kernel(ops, x, q, s, m, bias, out, ref, f"{kind} g{g} rows {rows}")
            continue
        # float32 sums of k products of O(1) terms, in another order: ~k * 2^-24 relative
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=2e-5, msg=f"{kind} g{g} rows {rows}")
    # q * s + m in one rounding (an FMA) vs two: one float32 ulp of the O(1) terms apart
    torch.testing.assert_close(ops.quant_dequantize(q, s, m), w.float(), rtol=2**-23, atol=2.5e-7)


def _check_integer_kernel(ops, x, q, s, m, bias, out, ref, msg):
    """out against (1) the exact reference on the kernel's own int16 activations (integer sums in
    float64, the mins term on the float inputs' group sums) and (2) the float reference within
    the activations' rounding: |x - q d| <= d / 2 per feature, so |dy_n| <= sum_k |w_nk| d_k / 2."""
    rows, k = x.shape
    xq, xd = ops.quant_activations(x)
    step = xd.double().repeat_interleave(QBLOCK, dim=1)  # [rows, k]
    # d = amax / QMAX (one ulp: the compiler may multiply by 1 / QMAX)
    assert xq.dtype == torch.int16
    torch.testing.assert_close(xd, x.view(rows, -1, QBLOCK).abs().amax(2) / QMAX, rtol=2**-23, atol=0)
    # x / d in float32 (perhaps x * (1 / d)): a few roundings of a value up to QMAX
    assert ((x.double() / step - xq.double()).abs() <= 0.5 + QMAX * 2**-22).all(), msg
    w_q = dequantize_reference(q, s, torch.empty(0)).double()  # q s (no mins)
    exact = F.linear(xq.double() * step, w_q, bias.double())
    # float32 accumulation of the scaled block sums and group sums: a few dozen roundings of
    # terms up to the sum of the absolute products, so the error is relative to that sum
    magnitude = (xq.double().abs() * step) @ w_q.abs().T + bias.double().abs()
    if m.numel():
        exact += x.double().view(rows, m.shape[1], -1).sum(2) @ m.double().T
        magnitude += x.double().abs().view(rows, m.shape[1], -1).sum(2) @ m.double().abs().T
    assert ((out.double() - exact).abs() <= 1e-5 * magnitude + 1e-6).all(), msg
    bound = (step / 2) @ w_q.abs().T
    assert ((out.double() - ref).abs() <= bound + 2e-5 + 1e-5 * ref.abs()).all(), msg


@pytest.mark.usefixtures("cpu_isa")  # every build of the kernels this CPU runs
def test_tile_path_under_inference_mode_in_threads():
    """The runner calls the kernel under inference_mode; the dequantised-tile path writes from the
    thread pool, whose threads must see that mode (they refused the write: a crash at prefill)."""
    ops = require_built(cpu_ops())
    gen = torch.Generator().manual_seed(3)
    q, s, m = _quantized("int4", 96, 64, 32, gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            x = torch.randn(37, 64, generator=gen)
            out = ops.quant_linear(x, q, s, m, torch.randn(96, generator=gen))
    finally:
        torch.set_num_threads(threads)
    assert out.shape == (37, 96) and torch.isfinite(out).all()


@pytest.mark.usefixtures("cpu_isa")  # every build of the kernels this CPU runs
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_integer_sums_exact(kind):
    """Integer inputs, unit scales, zero mins: every sum is an exact float32 integer (below 2^24)."""
    ops = require_built(cpu_ops())
    gen = torch.Generator().manual_seed(7)
    n, k, g = 45, 224, 32
    lo, hi = (0, 16) if kind == "int4" else (-128, 128)
    qi = torch.randint(lo, hi, (n, k), generator=gen)
    qi[:, ::QBLOCK] = torch.randint(0, 3, (n, k // QBLOCK), generator=gen)  # times QMAX: sums stay < 2^24
    q = pack_int4(qi) if kind == "int4" else qi.to(torch.int8)
    s = torch.ones(n, k // g)
    for rows in (1, 3, 8):
        x = torch.randint(-QMAX, QMAX + 1, (rows, k), generator=gen).float() / 64  # -512..512
        x = torch.round(x)
        x[:, ::QBLOCK] = QMAX  # each block's step d = QMAX / QMAX: the integer kernel's int16 x is x
        exact = x.long() @ qi.T
        assert torch.equal(ops.quant_linear(x, q, s, torch.zeros_like(s), None).long(), exact)
        assert torch.equal(ops.quant_linear(x, q, s, torch.empty(0), None).long(), exact)


def test_int4_pack_roundtrip_and_quantize_error():
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (7, 96), generator=gen, dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)
    w = torch.randn(7, 96, generator=gen)
    qw, s, m = quantize_int4(w, 32)
    err = (dequantize_reference(qw, s, m) - w).abs()
    assert (err <= s.repeat_interleave(32, dim=1) / 2 + 1e-6).all()  # within half a step
    q8, s8 = quantize_int8(w, 96)
    assert ((dequantize_reference(q8, s8, torch.empty(0)) - w).abs() <= s8 / 2 + 1e-6).all()
    shifted = w + 3  # off zero: the offset keeps the steps over the group's own range
    q8, s8, m8 = quantize_int8_offset(shifted, 32)
    err = (dequantize_reference(q8, s8, m8) - shifted).abs()
    assert (err <= s8.repeat_interleave(32, dim=1) / 2 + 1e-6).all()
    assert err.max() < (quantize_int8(shifted, 32)[1] / 2).max() / 2


def _random_blocks(type_name, rows, k, rng):
    """Raw GGUF blocks: from the gguf package's quantizer where it has one, else random bytes
    with finite float16 scales (every bit pattern of the integers is a valid block)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    qtype = GGMLQuantizationType[type_name]
    try:
        return quantize(rng.standard_normal((rows, k)).astype(np.float32), qtype)
    except NotImplementedError:
        block, nbytes = GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (rows, k // block, nbytes), dtype=np.uint8)
        f16 = lambda n: rng.uniform(0.001, 0.1, (rows, k // block, n)).astype(np.float16).view(np.uint8)  # noqa: E731
        if type_name in ("Q4_K", "Q5_K"):
            data[:, :, 0:4] = f16(2)  # d, dmin
        else:
            data[:, :, 208:210] = f16(1)  # Q6_K's d
        return data.reshape(rows, -1)


GGUF_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


GGUF_ACTIVATIONS = {"int8": 127, "int16": 32767}  # the kernel's activation codes -> QMAX (d = amax / QMAX)


def _gguf_weight(type_name, rng, activations="int8"):
    """A weight of 37 rows of type_name then 5 of Q8_0 (two segments, neither whole groups of
    16), K = 96 (legacy types: not a multiple of 256) or 512, codes laid out for these
    activations -> (packed, meta, float32 [42, K] as the gguf package dequantises it)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    k = 512 if type_name.endswith("_K") else 96
    segments = [(type_name, _random_blocks(type_name, 37, k, rng)), ("Q8_0", _random_blocks("Q8_0", 5, k, rng))]
    packed, meta = pack_segments(segments, activations)
    w = np.concatenate([dequantize(d, GGMLQuantizationType[t]) for t, d in segments]).astype(np.float32)
    return packed, meta, torch.from_numpy(w)


@pytest.mark.usefixtures("cpu_isa")  # every build of the kernels this CPU runs
@pytest.mark.parametrize("activations", GGUF_ACTIVATIONS)
@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_gguf_blocks_repack_exactly(type_name, activations):
    """Each type's repacked rows (either layout) dequantise to the gguf package's values bit for
    bit (in any order, a row at a time: the embedding's lookup)."""
    ops = require_built(cpu_ops())
    packed, meta, w = _gguf_weight(type_name, np.random.default_rng(0), activations)
    assert torch.equal(ops.gguf_dequantize_rows(packed, meta, w.shape[1], torch.arange(42)), w)
    rows = torch.tensor([41, 0, 36, 37, 17, 17])
    assert torch.equal(ops.gguf_dequantize_rows(packed, meta, w.shape[1], rows), w[rows])
    # a row holds the file's bytes (Q4_K / Q5_K: their 6-bit scales as bytes, 4 more a block); each
    # segment is padded to whole groups of 16 rows (37 -> 48, 5 -> 16)
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    row = w.shape[1] // block * (nbytes + 4 if type_name in ("Q4_K", "Q5_K") else nbytes)
    assert packed.numel() == 48 * row + 16 * (w.shape[1] // 32 * 34)


def _activation_span(types, activations):
    """Features a step of the activations covers: int8 for a weight with a K-quant group, one
    step a super-block of 256 (llama.cpp's Q8_K); else one a block of 32."""
    return 256 if activations == "int8" and any(t.endswith("_K") for t in types) else QBLOCK


def _assert_within_rounding(out, x, w, bias, qmax, span, what):
    """out [T, N] against float64 x w^T + bias within the activations' rounding (|x - q d| <=
    d / 2, d = amax / qmax a span of features) and float32 accumulation."""
    rows = x.shape[0]
    ref = x.double() @ w.T + bias.double()
    step = x.view(rows, -1, span).abs().amax(2).double().repeat_interleave(span, dim=1) / qmax
    magnitude = x.double().abs() @ w.abs().T + bias.double().abs()
    bound = (step / 2) @ w.abs().T + 1e-5 * magnitude
    assert ((out - ref).abs() <= bound).all(), (what, rows, ((out - ref).abs() / bound).max())


@pytest.mark.usefixtures("cpu_isa")
@pytest.mark.parametrize("activations", GGUF_ACTIVATIONS)
@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_gguf_linear_matches_float_reference(type_name, activations):
    """The kernel (1-8 rows: one tile; more: tiles of 8 over each group of weight rows) against
    float64 on the gguf package's dequantised weight: within the activations' rounding (d =
    amax / 127 (int8) or 32767 (int16) a block of 32, or int8 a super-block of 256 where a
    K-quant takes them) and float32 accumulation."""
    ops = require_built(cpu_ops())
    gen = torch.Generator().manual_seed(5)
    packed, meta, w = _gguf_weight(type_name, np.random.default_rng(1), activations)
    w = w.double()
    bias = torch.randn(42, generator=gen)
    span = _activation_span([type_name], activations)
    for rows in (1, 2, 3, 5, 8, 9, 13, 16, 17, 31, 64, 67):
        x = torch.randn(rows, w.shape[1], generator=gen)
        x[0, :40] *= 100  # blocks of very different steps
        out = ops.gguf_linear(x, packed, meta, bias).double()
        _assert_within_rounding(out, x, w, bias, GGUF_ACTIVATIONS[activations], span, type_name)


@pytest.mark.usefixtures("cpu_isa")
@pytest.mark.parametrize("activations", GGUF_ACTIVATIONS)
@pytest.mark.parametrize("types", [("Q4_K", "Q6_K", "Q5_K"), ("Q6_K", "Q4_0", "Q8_0", "Q4_1"), ("Q5_0", "Q8_0")])
def test_gguf_fused_weight_of_mixed_types(types, activations):
    """A fused weight (QKV, gate-up) whose segments are of different types, odd row counts (not
    whole groups), K = 768 (3 super-blocks): one quantization of the activations serves every
    group (a K-quant among them: int8 steps a super-block of 256 for all), 1-8 rows and more."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    ops = require_built(cpu_ops())
    rng, gen = np.random.default_rng(3), torch.Generator().manual_seed(6)
    k = 768
    segments = [(t, _random_blocks(t, n, k, rng)) for t, n in zip(types, (21, 16, 9, 3))]
    packed, meta = pack_segments(segments, activations)
    w = torch.from_numpy(
        np.concatenate([dequantize(d, GGMLQuantizationType[t]) for t, d in segments]).astype(np.float64)
    )
    bias = torch.randn(w.shape[0], generator=gen)
    span = _activation_span(types, activations)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 13):
        x = torch.randn(rows, k, generator=gen)
        x[-1, 300:310] *= 50  # one row with a super-block of a much larger step
        out = ops.gguf_linear(x, packed, meta, bias).double()
        _assert_within_rounding(out, x, w, bias, GGUF_ACTIVATIONS[activations], span, types)


@pytest.mark.usefixtures("cpu_isa")
@pytest.mark.parametrize("activations", GGUF_ACTIVATIONS)
def test_gguf_decode_rows_over_many_claims(activations):
    """Decode rows (1-8) of a weight of many groups, handed to the threads in runs of ~256 KiB
    claimed in turn: a fused weight of three types (3500 rows, K = 256: several runs, the last
    short) is whole against float64 on the gguf package's dequantisation, on 1 and 2 threads
    (a run skipped would leave the output's uninitialised rows)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    ops = require_built(cpu_ops())
    rng, gen = np.random.default_rng(4), torch.Generator().manual_seed(8)
    k = 256
    segments = [(t, _random_blocks(t, n, k, rng)) for t, n in (("Q6_K", 1500), ("Q4_0", 1700), ("Q8_0", 300))]
    packed, meta = pack_segments(segments, activations)
    w = torch.from_numpy(
        np.concatenate([dequantize(d, GGMLQuantizationType[t]) for t, d in segments]).astype(np.float64)
    )
    bias = torch.randn(w.shape[0], generator=gen)
    span = _activation_span(["Q6_K"], activations)
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for rows in (1, 3, 8):
                x = torch.randn(rows, k, generator=gen)
                out = ops.gguf_linear(x, packed, meta, bias).double()
                _assert_within_rounding(out, x, w, bias, GGUF_ACTIVATIONS[activations], span, (n_threads, rows))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.usefixtures("cpu_isa")
@pytest.mark.parametrize("activations", GGUF_ACTIVATIONS)
@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_gguf_linear_integer_sums_exact(type_name, activations):
    """Activations the codes hold exactly (integers, each block's largest the codes' largest,
    127 or 32767: d = 1): the kernel's only error is float32 accumulation of exact block sums,
    so it is that close to float64 (a wrong code, quad, pair, offset or scale is off by far more)."""
    ops = require_built(cpu_ops())
    gen = torch.Generator().manual_seed(9)
    qmax = GGUF_ACTIVATIONS[activations]
    packed, meta, w = _gguf_weight(type_name, np.random.default_rng(2), activations)
    for rows in (1, 4, 8, 11, 16, 19, 31, 35, 67):
        x = torch.randint(-min(300, qmax), min(300, qmax) + 1, (rows, w.shape[1]), generator=gen).float()
        x[:, ::QBLOCK] = qmax
        ref = x.double() @ w.double().T
        magnitude = x.double().abs() @ w.double().abs().T
        out = ops.gguf_linear(x, packed, meta, None).double()
        assert ((out - ref).abs() <= 2e-6 * magnitude).all(), (type_name, rows)


def test_gguf_layer_without_the_extension_holds_the_dequantised_weight():
    """No C++ kernels (no compiler): a GGUF linear loads the same row blobs and computes with
    the gguf package's dequantised weight."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from pagedllm.models.layers.linear import ReplicatedLinear
    from pagedllm.models.layers.quantization.gguf_method import GGUFLinearMethod, row_blob

    data = _random_blocks("Q4_K", 20, 256, np.random.default_rng(3))
    method = GGUFLinearMethod(["Q4_K", "Q6_K"], {})
    method.ops = None
    layer = ReplicatedLinear(256, 20, False, method)
    layer.weight.weight_loader(layer.weight, torch.from_numpy(row_blob(data, "Q4_K", method.types)))
    method.process_weights_after_loading(layer)
    x = torch.randn(3, 256)
    w = torch.from_numpy(dequantize(data, GGMLQuantizationType.Q4_K).astype(np.float32))
    torch.testing.assert_close(layer(x), x @ w.T)


def test_gguf_types_without_a_kernel_are_refused_by_name():
    from pagedllm.models.layers.quantization.gguf import GGUFConfig

    with pytest.raises(ValueError, match="linear weights of type IQ2_XS are not served"):
        GGUFConfig("m.gguf", {"blk.0.attn_q.weight": "IQ2_XS", "blk.0.attn_k.weight": "Q4_K"})
    from pagedllm.models.layers.quantization.gguf_repack import row_bytes

    with pytest.raises(ValueError, match="a Q4_K row of 576 features is not whole blocks of 256"):
        row_bytes("Q4_K", 576)
    with pytest.raises(ValueError, match="GGUF activations must be one of int8, int16, not 'int4'"):
        pack_segments([("Q4_0", np.zeros((16, 18), dtype=np.uint8))], "int4")


def test_gguf_activations_variable_is_checked(monkeypatch):
    from pagedllm import envs

    monkeypatch.delenv("PAGEDLLM_GGUF_ACTIVATIONS", raising=False)
    assert envs.PAGEDLLM_GGUF_ACTIVATIONS == "int8"  # the default
    monkeypatch.setenv("PAGEDLLM_GGUF_ACTIVATIONS", "fp8")
    with pytest.raises(ValueError, match="PAGEDLLM_GGUF_ACTIVATIONS='fp8' is not valid"):
        envs.PAGEDLLM_GGUF_ACTIVATIONS


def test_bad_flags_are_value_errors():
    with pytest.raises(ValueError, match="quantization must be one of"):
        validate_quantization("int3", None, "cpu", "float32")
    with pytest.raises(ValueError, match="quantization_group_size"):
        validate_quantization("int4", 48, "cpu", "float32")
    with pytest.raises(ValueError, match="quantization_group_size"):
        validate_quantization("int8", 48, "cpu", "float32")
    with pytest.raises(ValueError, match="quantization_group_size"):
        validate_quantization("int4", -1, "cpu", "float32")  # per channel: int8 only
    with pytest.raises(ValueError, match="quantization_group_size"):
        validate_quantization("gguf", 32, "cpu", "float32")
    with pytest.raises(ValueError, match="runs on the CPU in float32"):
        validate_quantization("int8", None, "cpu", "bfloat16")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        from pagedllm.models.download import resolve_model

        resolve_model("/nonexistent/model.gguf")


def _greedy(llm, prompts):
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _agreement(ours, ref) -> float:
    """Share of the reference's tokens before each prompt's first divergence."""
    same = sum(next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(r)) for o, r in zip(ours, ref))
    return same / sum(len(r) for r in ref)


@pytest.fixture(scope="module")
def agreement_prompts(tokenizer):
    return greedy_equality_prompts(tokenizer)


@pytest.fixture(scope="module")
def float32_greedy(model_dir, agreement_prompts):
    from pagedllm import LLM

    return _greedy(LLM(model_dir, enable_prefix_caching=False, kv_cache_memory=2**28), agreement_prompts)


def _quantized_agreement(model, quant, prompts, ref):
    """-> (share of float32's greedy tokens before the first divergence, the engine's model)"""
    from pagedllm import LLM

    require_built(cpu_ops())
    # 8 requests at a time: the decode steps have 8 rows, the int8 layout's integer kernel's (int16
    # activations); 16 would take its dequantised tiles (float activations) and leave it unmeasured.
    llm = LLM(model, quantization=quant, enable_prefix_caching=False, kv_cache_memory=2**28, max_num_seqs=DECODE_ROWS)
    runner = llm.llm_engine.core.model_executor.driver_worker.model_runner
    assert runner.decode_loop is not None, "the C++ decode loop runs quantized linears"
    agree = _agreement(_greedy(llm, prompts), ref)
    print(f"{quant}: {agree:.1%} of float32's greedy tokens before the first divergence")
    return agree, runner.model


@pytest.mark.model
def test_gguf_greedy_agrees_with_float32(agreement_prompts, float32_greedy, monkeypatch):
    """The default model's float32 directory was dequantised from this very Q4_1 file. Its
    weights are held in the file's blocks: the Q8_0 token embedding too, shared by the tied LM
    head, so the resident weights are the file's bytes (its metadata, the vocabulary, aside).
    int16 activations: the float32 model's greedy tokens exactly."""
    import os

    from pagedllm.models.download import find_gguf
    from pagedllm.models.layers.quantization.layouts import weight_bytes

    monkeypatch.setenv("PAGEDLLM_GGUF_ACTIVATIONS", "int16")
    agree, model = _quantized_agreement(None, "gguf", agreement_prompts, float32_greedy)
    assert agree == 1.0  # README: 100 %
    assert model.embed_tokens.weight is None and model.lm_head.qweight is model.embed_tokens.qweight
    assert (model.lm_head.scales[:, 1] < 256).all()  # codes in pairs: the int16 kernels
    held, file_bytes = weight_bytes(model), os.path.getsize(find_gguf())
    print(f"gguf: weights held {held / 1e6:.1f} MB, file {file_bytes / 1e6:.1f} MB")
    assert held <= 1.1 * file_bytes


@pytest.mark.model
def test_gguf_int8_activations_greedy_agreement(agreement_prompts, float32_greedy):
    """int8 activations (the default; llama.cpp's Q8 scheme, d = amax / 127 a block of 32) round
    each input by up to 1/254 of its block's largest: greedy decoding of a 135M model drifts from
    float32's within 32 tokens on many prompts (measured: 46.7 % of the tokens before the first
    divergence; a torch simulation of this rounding on the float weights gave 62.9 %). The bound
    is the measurement less a margin for the batches' composition; the quality proof is
    perplexity within 1 % of llama.cpp's on the same file (tests/benchmarks/test_llama_cpp_perplexity.py)."""
    agree, model = _quantized_agreement(None, "gguf", agreement_prompts, float32_greedy)
    assert (model.lm_head.scales[:, 1] >= 256).all()  # codes in quads: the int8 kernels
    assert agree >= INT8_ACTIVATIONS_AGREEMENT


@pytest.mark.model
def test_int8_greedy_agrees_with_float32(model_dir, agreement_prompts, float32_greedy):
    """int8 in groups of 32 with an offset (the default, 256 codes over each group's range): the
    default model's weights are Q4_1 values, 16 evenly spaced levels, which 255 = 15 x 17 steps
    hold exactly (symmetric scales over [-amax, amax] blur them; 254 steps from the midpoint
    agreed on 80 %)."""
    assert _quantized_agreement(model_dir, "int8", agreement_prompts, float32_greedy)[0] == 1.0  # README: 100 %
