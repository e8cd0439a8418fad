"""The C++ decode kernel reads the paged cache directly; it must agree with the torch path
(which gathers the context) on random paged caches, for GQA ratios 1, 3 and 8."""

import numpy as np
import pytest
import torch
from kernel_utils import check_rope_in_place, paged_step, require_built, require_decode_loop

from pagedllm.attention.backends.cpu_attn.kernels import decode_kernel
from pagedllm.attention.backends.cpu_attn.paged_attention import paged_attention
from pagedllm.attention.backends.torch_sdpa.metadata import build_attention_metadata


@pytest.mark.parametrize(
    "H, Hkv, D, bs, window",
    [
        (9, 3, 64, 16, None),
        (4, 4, 32, 4, None),
        (16, 2, 64, 32, None),
        (8, 2, 128, 16, None),
        (8, 2, 128, 16, 21),
        (4, 1, 256, 4, 7),
    ],
)
@pytest.mark.usefixtures("cpu_isa")  # every build of the kernels this CPU runs
def test_decode_kernel_matches_torch_path(H, Hkv, D, bs, window):
    """window: a sliding-window layer's metadata (AttentionMetadata.windowed); the blocks
    before each window are poisoned with NaN, as if freed and reused: neither path reads them."""
    require_built(decode_kernel())
    rng = np.random.default_rng(H * 100 + bs)
    # A mixed batch: decodes (one new token) around a prefill chunk with a cached past.
    q_lens = np.array([1, 1, 5, 1, 1])
    seq_lens = np.array([1, 37, 20, bs, 3 * bs + 1], dtype=np.int32)
    table, S, qsl, slots = paged_step(q_lens, seq_lens, bs, rng)
    T = int(q_lens.sum())
    q, k, v = (torch.randn(T, H, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D))
    outs = []
    # The reference's prefill chunk, the cpu backend's, and the chunk as 5 decode queries (a
    # verification step's metadata, max_decode_query_len).
    for by_pages, max_q in ((False, 1), (True, 1), (True, 5)):
        kc, vc = (
            torch.randn(S, Hkv, D, generator=torch.Generator().manual_seed(0)),
            torch.randn(S, Hkv, D, generator=torch.Generator().manual_seed(1)),
        )
        meta = build_attention_metadata(
            qsl, seq_lens, table, bs, slots, decode_by_pages=by_pages, max_decode_query_len=max_q
        )
        assert meta.all_decode == (max_q == 5)
        if window:
            meta = meta.windowed(window)
            for row, (s, ql) in enumerate(zip(seq_lens, q_lens)):  # tokens no query of it sees
                dead = np.arange(max(int(s) - int(ql) - window + 1, 0) // bs * bs)
                kc[table[row, dead // bs] * bs + dead % bs] = float("nan")
        outs.append(paged_attention(q, k, v, kc, vc, meta, D**-0.5))
    assert torch.isfinite(outs[0]).all()
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(outs[2], outs[0], atol=2e-5, rtol=2e-5)
    if window:  # against a dense reference: each query over its last `window` keys
        kc, vc = (
            torch.randn(S, Hkv, D, generator=torch.Generator().manual_seed(0)),
            torch.randn(S, Hkv, D, generator=torch.Generator().manual_seed(1)),
        )
        kc[slots], vc[slots] = k, v
        t = 0
        for row, (s, ql) in enumerate(zip(seq_lens, q_lens)):
            for p in range(s - ql, s):
                keys = np.arange(max(p - window + 1, 0), p + 1)
                ks = torch.from_numpy(table[row, keys // bs].astype(np.int64) * bs + keys % bs)
                kr = kc[ks].repeat_interleave(H // Hkv, dim=1)  # [n, H, D]
                w = torch.softmax(torch.einsum("hd,nhd->hn", q[t], kr) * D**-0.5, dim=-1)
                ref = torch.einsum("hn,nhd->hd", w, vc[ks].repeat_interleave(H // Hkv, dim=1))
                torch.testing.assert_close(outs[1][t], ref, atol=2e-5, rtol=2e-5)
                torch.testing.assert_close(outs[2][t], ref, atol=2e-5, rtol=2e-5)
                t += 1


# Output rounding of each dtype (the kernel computes in float32 throughout).
FLOAT64_TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


# (query, cache) dtypes: a model's own, and a float32 model's bfloat16 cache (--kv-cache-dtype).
DTYPE_PAIRS = [(d, d) for d in FLOAT64_TOL] + [(torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("dtype, cache_dtype", DTYPE_PAIRS, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize(
    "H, Hkv, D, bs, window",
    [
        (9, 3, 64, 16, 0),
        (8, 8, 64, 4, 0),
        (12, 1, 64, 32, 0),
        (8, 2, 128, 16, 0),
        (6, 2, 128, 8, 19),
        (8, 1, 256, 16, 0),
        (10, 2, 64, 5, 0),
        (4, 2, 128, 7, 9),
        (4, 1, 48, 16, 0),
        (6, 3, 80, 3, 0),
    ],
)
@pytest.mark.usefixtures("cpu_isa")  # every build of the kernels this CPU runs
def test_decode_kernel_against_float64(dtype, cache_dtype, H, Hkv, D, bs, window):
    """float32, bfloat16 and float16 queries and caches, and float32 queries over a bfloat16
    cache, each row widened exactly (each build's paths: VL-key score tiles reduced together, a
    bfloat16 model's pairs dotted straight from the page where AVX512-BF16 has them, every query
    head of a KV head in one pass over the values, in column runs) against attention in float64
    over the same values: a bfloat16 cache under float32 queries to float32's tolerance. Lengths cut tiles and blocks anywhere
    (block sizes 3, 5, 7); head dims 48 and 80 take the portable loop."""
    require_built(decode_kernel())
    gen = torch.Generator().manual_seed(H * 7 + D + bs)
    seq_lens = torch.tensor([1, 7, 15, 16, 17, 40, 3 * bs + 5, 131], dtype=torch.int32)
    nb = -(-int(seq_lens.max()) // bs)
    B, S = len(seq_lens), (len(seq_lens) * nb + 3) * bs
    table = torch.randperm(S // bs, generator=gen)[: B * nb].view(B, nb).to(torch.int32)  # pages anywhere
    kc = torch.randn(S, Hkv, D, generator=gen).to(cache_dtype)
    vc = torch.randn(S, Hkv, D, generator=gen).to(cache_dtype)
    q = (torch.randn(B, H, D, generator=gen) * 2).to(dtype)
    out = decode_kernel()(q, kc, vc, table, seq_lens, bs, D**-0.5, window)
    assert out.dtype == dtype and out.shape == q.shape
    for b, L in enumerate(seq_lens.tolist()):
        keys = torch.arange(max(L - window, 0) if window else 0, L)
        slots = table[b, keys // bs].long() * bs + keys % bs
        k = kc[slots].double().repeat_interleave(H // Hkv, dim=1)  # [n, H, D]
        v = vc[slots].double().repeat_interleave(H // Hkv, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[b].double(), k) * D**-0.5, dim=-1)
        ref = torch.einsum("hn,nhd->hd", w, v)
        tol = FLOAT64_TOL[dtype]
        torch.testing.assert_close(out[b].double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.usefixtures("cpu_isa")  # every build of the kernels this CPU runs
def test_decode_requests_do_not_depend_on_the_batch_or_the_threads(dtype):
    """A task takes several KV heads of a request (all of them where the batch has requests
    enough, fewer where it does not), and the threads claim tasks in turn: each head's sums run
    in the same order however its heads are grouped, so a request alone, in a batch, and under
    1-3 threads gives the same bits."""
    require_built(decode_kernel())
    gen = torch.Generator().manual_seed(5)
    H, Hkv, D, bs = 16, 8, 64, 16
    seq_lens = torch.tensor([33, 1, 200, 16, 17, 64, 5, 130], dtype=torch.int32)
    nb = -(-int(seq_lens.max()) // bs)
    B, S = len(seq_lens), (len(seq_lens) * nb + 3) * bs
    table = torch.randperm(S // bs, generator=gen)[: B * nb].view(B, nb).to(torch.int32)
    kc, vc = (torch.randn(S, Hkv, D, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(B, H, D, generator=gen).to(dtype)
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(decode_kernel()(q, kc, vc, table, seq_lens, bs, D**-0.5, 0))
            for b in range(B):  # alone: the heads split over the threads' tasks
                alone = decode_kernel()(q[b : b + 1], kc, vc, table[b : b + 1], seq_lens[b : b + 1], bs, D**-0.5, 0)
                assert torch.equal(alone[0], outs[0][b]), (t, b)
    finally:
        torch.set_num_threads(threads)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@pytest.mark.usefixtures("cpu_isa")  # every build of the kernels this CPU runs
def test_decode_kernel_builds_prefetch_and_vector_paths():
    """Each x86 build has the vectorised decode path (the portable loop has no prefetches) with
    its prefetches (prefetcht0) for float32, bfloat16 and float16 caches: the compiler once
    dropped every _mm_prefetch of these loops without a word. Read from the build's machine
    code (where the compiler inlined the path: run_decode, decode_heads_vec, qk_block, pv_heads,
    prefetch_kv)."""
    import shutil
    import subprocess

    from pagedllm.csrc.build import NATIVE, cpu_extension, selected_isa

    if selected_isa() == NATIVE:
        pytest.skip("the portable build (not x86) has no vector path")
    if shutil.which("objdump") is None:
        pytest.skip("objdump (binutils) is not installed")
    ext = require_built(cpu_extension())
    asm = subprocess.run(
        ["objdump", "-d", "-C", "--no-show-raw-insn", ext.__file__], check=True, capture_output=True, text=True
    ).stdout
    prefetching = []  # names of the functions with a prefetcht0
    for chunk in asm.split("\n\n"):
        head, _, body = chunk.partition(">:\n")
        if "prefetcht0" in body:
            prefetching.append(head.split("<", 1)[-1])
    kernel_parts = ("run_decode<", "decode_heads_vec<", "qk_block<", "pv_heads<", "prefetch_kv<")
    for elem in ("float", "unsigned short", "c10::Half"):  # unsigned short: bfloat16 bits
        assert any(
            part in name and f"<{elem}" in name.replace(", ", "<") for name in prefetching for part in kernel_parts
        ), f"no prefetching decode path for {elem}"


@pytest.mark.usefixtures("cpu_isa")  # every build of the kernels this CPU runs
def test_fused_cpu_ops_match_the_torch_layers():
    """RMSNorm, SiLU-and-mul and RoPE (also on strided q/k views of a fused QKV output and a
    partial rotary dim): the fused ops equal the torch code of models/layers/."""
    from pagedllm.models.cpu_ops import cpu_ops
    from pagedllm.models.layers.activation import SiluAndMul
    from pagedllm.models.layers.layernorm import RMSNorm

    ops = require_built(cpu_ops())
    torch.manual_seed(0)
    with torch.inference_mode():
        norm = RMSNorm(576, 1e-5)
        assert norm.ops is ops  # chosen when the layer is built (here: on the CPU, float32)
        norm.weight.uniform_(0.5, 1.5)
        x = torch.randn(37, 576) * 3
        norm.ops = None
        ref = norm(x)
        norm.ops = ops
        torch.testing.assert_close(norm(x), ref, rtol=1e-6, atol=1e-6)

        act = SiluAndMul()
        x = torch.randn(5, 192) * 3  # the gate_up output of an MLP, [T, 2I]
        act.ops = None
        ref = act(x)
        act.ops = ops
        torch.testing.assert_close(act(x), ref, rtol=1e-6, atol=1e-6)

        check_rope_in_place(ops, torch.randn, lambda m: m, rtol=1e-6, atol=1e-6)


@pytest.mark.usefixtures("cpu_isa")  # every build of the kernels this CPU runs
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 128, 600])
def test_packed_linear_matches_f_linear(rows):
    """oneDNN on the packed weight, and (1-8 rows) the row-streaming kernel, equal F.linear;
    an in_features that is not a multiple of 16 exercises the kernel's scalar tail."""
    from kernel_utils import packed_linear
    from pagedllm.models.cpu_ops import cpu_ops
    from pagedllm.models.layers.cpu_packed_linear import packed_linear_supported

    if not packed_linear_supported(torch.float32):
        pytest.skip("oneDNN linear not available in this torch build")
    torch.manual_seed(rows)
    for in_features in (576, 100):
        lin = torch.nn.Linear(in_features, 1728, bias=True)
        x = torch.randn(rows, in_features)
        with torch.inference_mode():
            for small_ops in (None, require_built(cpu_ops())):
                torch.testing.assert_close(packed_linear(lin, small_ops)(x), lin(x), rtol=1e-5, atol=1e-5)


def test_large_float32_chunks_take_sgemm_where_the_cpu_lacks_avx512():
    """Without AVX-512, a float32 layer's chunks of LARGE_ROWS rows and more run F.linear on the
    plain weight (bit for bit), fewer rows and the LM head oneDNN's packed copy (bit for bit its
    own call), and the layer's method says so (eager_from_rows, which the decode loop reads);
    with AVX-512, oneDNN at every size."""
    from kernel_utils import packed_linear
    from pagedllm.models.cpu_ops import cpu_ops
    from pagedllm.models.layers.cpu_packed_linear import (
        CPUPackedLinearMethod,
        cpu_has_avx512,
        packed_linear_supported,
    )

    if not packed_linear_supported(torch.float32):
        pytest.skip("oneDNN linear not available in this torch build")
    ops = require_built(cpu_ops())
    torch.manual_seed(0)
    lin = torch.nn.Linear(320, 700, bias=True)
    large = CPUPackedLinearMethod.LARGE_ROWS
    with torch.inference_mode():
        layer, head = packed_linear(lin, ops), packed_linear(lin, ops, lm_head=True)
        assert layer.linear_method.eager_from_rows == (None if cpu_has_avx512() else large)
        assert head.linear_method.eager_from_rows is None
        for rows in (large - 1, large, large + 77):
            x = torch.randn(rows, 320)
            onednn = torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, layer.bias, "none", [], "")
            sgemm = not cpu_has_avx512() and rows >= large
            assert torch.equal(layer(x), torch.nn.functional.linear(x, lin.weight, lin.bias) if sgemm else onednn)
            assert torch.equal(head(x), onednn)
            torch.testing.assert_close(layer(x), lin(x), rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("cpu_isa")  # every build of the kernels this CPU runs
def test_linear_small_rows_do_not_depend_on_each_other():
    """Each of 1-8 rows comes out bit for bit as that row alone (its sum in the same order): a
    verification of k + 1 tokens equals k + 1 one-token steps. Float32 and bfloat16."""
    from pagedllm.models.cpu_ops import cpu_ops

    ops = require_built(cpu_ops())
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        w, b, x = torch.randn(300, 100, dtype=dtype), torch.randn(300, dtype=dtype), torch.randn(8, 100, dtype=dtype)
        alone = torch.cat([ops.linear_small(x[i : i + 1], w, b) for i in range(8)])
        for m in range(1, 9):
            assert torch.equal(ops.linear_small(x[:m], w, b), alone[:m]), (dtype, m)
        torch.testing.assert_close(alone.float(), (x.float() @ w.float().T + b.float()), rtol=2e-2, atol=2e-2)


def _runs_beside(call, attempts: int = 20) -> bool:
    """Whether another Python thread runs while call() is in progress. The switch interval is
    set far beyond the call, so the calling thread gives the GIL up only where it blocks or C
    code releases it: a probe thread, woken just before the call, reads the flag that is set
    around the call when it gets the GIL. If it got it only after the call (the OS had not run
    it yet), try again; a call that holds the GIL never lets it in."""
    import sys
    import threading

    state = {"in_call": False}
    interval = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        for _ in range(attempts):
            go, seen = threading.Event(), []

            def probe():
                go.wait()
                seen.append(state["in_call"])

            t = threading.Thread(target=probe)
            t.start()
            go.set()
            state["in_call"] = True
            call()
            state["in_call"] = False
            t.join()
            if seen == [True]:
                return True
        return False
    finally:
        sys.setswitchinterval(interval)


def test_a_kernel_lets_other_threads_run():
    """The kernels release the GIL while they run: another Python thread runs during one call of
    linear_small (one torch thread, a 4096 x 8192 weight: tens of milliseconds). Holding the GIL,
    as they did, the KV connector's threads waited for the end of each decode step. The probe's
    own check: a C call that holds the GIL (sorting floats) never lets the thread in."""
    import random

    from pagedllm.models.cpu_ops import cpu_ops

    ops = require_built(cpu_ops())
    w, x = torch.randn(4096, 8192), torch.randn(8, 8192)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the probe has a core of its own
    try:
        assert _runs_beside(lambda: ops.linear_small(x, w, None))
        floats = [random.random() for _ in range(300_000)]
        assert not _runs_beside(lambda: sorted(floats), attempts=3)
    finally:
        torch.set_num_threads(threads)


def test_an_interrupted_build_does_not_hang_the_next(tmp_path):
    """torch's `lock` file, left by a build killed midway, is removed under pagedllm's own OS
    lock and the build goes on (without that, every later start waits on it forever)."""
    import os
    import subprocess
    import sys
    import textwrap

    require_built(decode_kernel())
    src = tmp_path / "src"
    src.mkdir()
    (src / "add_one.cpp").write_text(  # pybind11 alone: seconds to compile, not minutes
        "#include <pybind11/pybind11.h>\n"
        "int add_one(int x) { return x + 1; }\n"
        "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def(\"add_one\", &add_one); }\n"
    )
    code = textwrap.dedent(f"""
        import os
        from pathlib import Path
        from torch.utils import cpp_extension
        from pagedllm.csrc import build
        name = build.extension_name("pagedllm_lock_test", Path({str(src)!r}))
        d = cpp_extension._get_build_directory(name, verbose=False)
        open(os.path.join(d, "lock"), "w").close()      # as a killed build leaves it
        m = build.build_extension("pagedllm_lock_test", Path({str(src)!r}), ["add_one.cpp"])
        print(m.add_one(41), os.path.exists(os.path.join(d, "lock")))
    """)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")},
    )
    assert out.stdout.split() == ["42", "False"], out.stderr[-2000:]


def test_a_kernel_that_did_not_build_fails_where_a_compiler_exists(monkeypatch):
    """The kernel tests' verdict when an extension is None: a failure naming the build error
    on a machine with a compiler, a skip saying so on one without."""
    from pagedllm.csrc import build

    monkeypatch.setitem(build.build_failures, "pagedllm_x", "RuntimeError: error: expected ';'")
    monkeypatch.delenv("PAGEDLLM_NO_CPU_KERNELS", raising=False)
    monkeypatch.setenv("CXX", "sh")  # on PATH everywhere: "a compiler exists"
    with pytest.raises(pytest.fail.Exception, match="pagedllm_x: RuntimeError: error: expected ';'"):
        require_built(None)
    monkeypatch.setenv("PAGEDLLM_NO_CPU_KERNELS", "0")  # off, as envs.py reads it: still a failure
    with pytest.raises(pytest.fail.Exception, match="pagedllm_x"):
        require_built(None)
    # The decode loop's verdict: missing while nothing turns it off is a failure, not a skip.
    from types import SimpleNamespace

    monkeypatch.setenv("PAGEDLLM_CPU_DECODE_LOOP", "1")
    with pytest.raises(pytest.fail.Exception, match="did not apply to this model: pagedllm_x"):
        require_decode_loop(SimpleNamespace(decode_loop=None))
    monkeypatch.setenv("PAGEDLLM_CPU_DECODE_LOOP", "0")
    with pytest.raises(pytest.skip.Exception, match="PAGEDLLM_CPU_DECODE_LOOP=0"):
        require_decode_loop(SimpleNamespace(decode_loop=None))
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    with pytest.raises(pytest.skip.Exception, match=r"no C\+\+ compiler on this machine"):
        require_built(None)
    monkeypatch.setenv("PAGEDLLM_NO_CPU_KERNELS", "1")
    with pytest.raises(pytest.skip.Exception, match=r"PAGEDLLM_NO_CPU_KERNELS=1"):
        require_built(None)
    assert require_built(build) is build


def test_each_isa_build_is_compiled_for_its_level(cpu_isa):
    """The build a process loads is the variant asked for ($PAGEDLLM_CPU_ISA, set by the
    fixture), compiled with that level's instruction set and no higher: the AVX2 build has no
    AVX-512 path in it, so its tests test the AVX2 code."""
    from pagedllm.csrc import build
    from pagedllm.models.cpu_ops import cpu_ops

    assert build.selected_isa() == cpu_isa
    ext = require_built(cpu_ops())
    assert ext.__name__.startswith(f"pagedllm_cpu_{cpu_isa}_")
    assert ext.compiled_isa() == cpu_isa


def test_isa_variants_this_cpu_runs(monkeypatch):
    """x86-64 CPUs with AVX2 run the avx2 build, those with AVX-512 VNNI and BF16 both (read from
    /proc/cpuinfo's flags, here against torch's own CPU detection); one the CPU cannot run is
    refused by name."""
    import platform

    from pagedllm.csrc import build

    isas = build.runnable_isas()
    if platform.machine() != "x86_64":
        assert isas == ["native"]
        return
    torch_level = torch.backends.cpu.get_cpu_capability()  # "AVX2", "AVX512", "DEFAULT"
    assert ("avx2" in isas) == (torch_level in ("AVX2", "AVX512"))
    if "avx512" in isas:
        assert torch_level == "AVX512" and isas == ["avx512", "avx2"]
    monkeypatch.delenv("PAGEDLLM_CPU_ISA", raising=False)
    assert build.selected_isa() == isas[0]
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "avx10")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_ISA='avx10': this CPU runs"):
        build.selected_isa()
