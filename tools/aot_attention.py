"""Compile the engine's Triton attention kernels for a GPU that is not here (ahead of time, no
driver), for every step shape the engine launches, and report each kernel variant's shared
memory, registers and local memory (spills).

The launches are the backend's own (attention/backends/triton_attn/paged_attention.py
`paged_attention_launches`, on CPU tensors laid out as the model runner lays them out), compiled
by pagedllm/kernels/triton_aot.py. Run it with TRITON_INTERPRET unset:

    PYTHONPATH=. python tools/aot_attention.py --arch 90 --heads 32 8 --head-dim 64 --dtype bfloat16

Exit status 1 when a variant needs more shared memory than its architecture has.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np
import torch

from pagedllm.attention.backends.triton_attn import TritonAttentionBackend
from pagedllm.attention.backends.triton_attn.metadata import build_triton_metadata
from pagedllm.attention.backends.triton_attn.paged_attention import paged_attention_launches
from pagedllm.attention.kv_quant import SCALE_DTYPE, is_quantized, resolve_kv_cache_dtype
from pagedllm.kernels.triton_aot import MAX_SHARED, compile_launch, gpu_target, specialise
from pagedllm.kernels.triton_launch import KernelLaunch

# (name, [(cached, new) per request], captured): the step shapes the engine launches.
# "captured" lays the step out as a CUDA-graph decode step (worker/cuda_graph.py) does.
SCENARIOS = [
    ("decode, 1 request, 1 block", [(5, 1)], False),
    ("decode, 16 requests", [(100 + 37 * i, 1) for i in range(16)], False),
    ("decode, 1 request, long context (split-K)", [(4000, 1)], False),
    ("prefill, 1 request", [(0, 100)], False),
    ("mixed, 5 requests", [(0, 37), (50, 1), (300, 1), (17, 20), (1000, 1)], False),
    ("captured decode, 1 request", [(200, 1)], True),
    ("captured decode, 8 requests", [(200, 1)] * 8, True),
    # A sliding-window layer (Gemma 3's local layers, Mistral): window 512 (the decode variant
    # is the captured one too: a graph's metadata only changes the split count).
    ("decode, sliding window", [(1000 + 37 * i, 1) for i in range(4)], False, 512),
    ("mixed, sliding window", [(0, 37), (700, 1), (600, 64)], False, 512),
]


@dataclass
class CompiledVariant:
    kernel: str
    scenarios: list
    constexprs: dict
    num_warps: int
    shared: int  # dynamic shared memory, bytes
    registers: int  # per thread
    local: int  # local memory per thread, bytes (> 0: spills or a stack)
    compile_s: float


def scenario_launches(
    reqs,
    captured: bool,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    max_model_len: int,
    kv_cache_dtype: str = "auto",
    sliding_window: Optional[int] = None,
) -> list[KernelLaunch]:
    """One layer's launches for a step of requests (cached, new), with tensors laid out as
    the model runner makes them (q/k/v views of one fused projection, the cache
    [slots, Hkv, D], block-table columns up to the longest sequence, or all of them when
    captured)."""
    H, Hkv, D = num_heads, num_kv_heads, head_dim
    q_lens = np.array([n for _, n in reqs])
    seq_lens = np.array([c + n for c, n in reqs], dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    T = int(qsl[-1])
    max_blocks = -(-max_model_len // block_size)
    nb = max_blocks if captured else int(-(-seq_lens.max() // block_size))
    block_table = np.zeros((len(reqs), max_blocks), dtype=np.int32)[:, :nb]
    num_slots = (1 + len(reqs) * max_blocks) * block_size
    qkv = torch.zeros(T, (H + 2 * Hkv) * D, dtype=dtype)  # [T, (H + 2 Hkv) D]
    q, k, v = (t.view(T, -1, D) for t in qkv.split([H * D, Hkv * D, Hkv * D], dim=-1))
    cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
    k_cache, v_cache = (torch.zeros(num_slots, Hkv, D, dtype=cache_dtype) for _ in range(2))
    kv_scales = (
        tuple(torch.zeros(num_slots, Hkv, dtype=SCALE_DTYPE) for _ in range(2)) if is_quantized(cache_dtype) else None
    )
    slots = torch.zeros(T, dtype=torch.int64)
    if captured:
        meta = TritonAttentionBackend("cpu").build_graph_metadata(
            slots,
            torch.from_numpy(qsl),
            torch.from_numpy(seq_lens),
            torch.from_numpy(np.ascontiguousarray(block_table)),
            Hkv,
            block_size,
            max_model_len,
        )
    else:
        meta = build_triton_metadata(
            qsl,
            seq_lens,
            block_table,
            block_size,
            slots,
            max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()),
        )
    return paged_attention_launches(
        q,
        k,
        v,
        k_cache,
        v_cache,
        meta,
        D**-0.5,
        torch.empty_like(q),
        kv_scales=kv_scales,
        sliding_window=sliding_window,
    )


def compile_engine_kernels(
    arch: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    max_model_len: int = 4096,
    kv_cache_dtype: str = "auto",
    only: str = "",
) -> list[CompiledVariant]:
    """Every distinct kernel variant of SCENARIOS (those whose name contains `only`), compiled
    for sm_<arch>."""
    target = gpu_target(arch)
    variants: dict[str, CompiledVariant] = {}
    for name, reqs, captured, *window in SCENARIOS:
        if only not in name:
            continue
        for launch in scenario_launches(
            reqs, captured, num_heads, num_kv_heads, head_dim, block_size, dtype, max_model_len, kv_cache_dtype, *window
        ):
            _, signature, constexprs, attrs = specialise(launch, target)
            key = repr(
                (
                    launch.kernel.__name__,
                    signature,
                    sorted(constexprs.items()),
                    sorted(attrs.items()),
                    sorted(launch.options.items()),
                )
            )
            if key in variants:
                variants[key].scenarios.append(name)
                continue
            t0 = time.perf_counter()
            c = compile_launch(launch, arch)
            variants[key] = CompiledVariant(
                launch.kernel.__name__,
                [name],
                {k: str(v) for k, v in launch.constexprs.items()},
                launch.options["num_warps"],
                c["shared"],
                c["registers"],
                c["local"],
                round(time.perf_counter() - t0, 2),
            )
    return list(variants.values())


def _compile_combo(
    arch: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: str,
    max_model_len: int,
    kv_cache_dtype: str,
    only: str,
) -> list[CompiledVariant]:
    """compile_engine_kernels for one (arch, dtype, KV dtype), by names a worker process can take."""
    return compile_engine_kernels(
        arch, num_heads, num_kv_heads, head_dim, block_size, getattr(torch, dtype), max_model_len, kv_cache_dtype, only
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--arch",
        type=int,
        nargs="+",
        default=[90],
        choices=sorted(MAX_SHARED),
        help="compute capabilities, e.g. 80 (A100) 90 (H100/H200)",
    )
    ap.add_argument(
        "--heads",
        type=int,
        nargs=2,
        default=[32, 8],
        metavar=("H", "HKV"),
        help="query and KV heads (default: Llama-3.2-1B's 32 8)",
    )
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        default=["auto"],
        choices=["auto", "int8", "fp8_e4m3", "fp8_e5m2"],
        help="the KV cache's element (int8 / fp8: with per-token scales; fp8 needs sm_89+)",
    )
    ap.add_argument("--scenario", default="", help="only the scenarios whose name contains this")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ap.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="(arch, dtype, KV dtype) combinations compiled at once, each in its own process (default: one per core)",
    )
    a = ap.parse_args(argv)
    if a.jobs < 1:
        ap.error(f"--jobs must be at least 1, got {a.jobs}")
    combos = [(arch, dt, kv) for arch in a.arch for dt in a.dtype for kv in a.kv_cache_dtype]
    jobs = [
        (arch, a.heads[0], a.heads[1], a.head_dim, a.block_size, dt, a.max_model_len, kv, a.scenario)
        for arch, dt, kv in combos
    ]
    if a.jobs == 1 or len(jobs) == 1:
        results = [_compile_combo(*j) for j in jobs]
    else:  # spawned: a forked child would inherit the parent's torch / Triton state
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(min(a.jobs, len(jobs)), mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(_compile_combo, *zip(*jobs)))
    report, ok = [], True
    for (arch, dt, kv), variants in zip(combos, results):
        for v in variants:
            fits = v.shared <= MAX_SHARED[arch]
            ok &= fits
            report.append({"arch": arch, "dtype": dt, "kv_cache_dtype": kv, "fits_shared": fits, **asdict(v)})
    if a.json:
        print(
            json.dumps(
                {"ok": ok, "max_shared": MAX_SHARED, "scenarios": [name for name, *_ in SCENARIOS], "variants": report}
            )
        )
    else:
        print(
            f"{'arch':>4} {'dtype':>8} {'kernel':<26} {'warps':>5} {'shared':>7} {'regs':>4} "
            f"{'local':>5} {'s':>5}  scenarios"
        )
        for r in report:
            print(
                f"{r['arch']:>4} {r['dtype']:>8} {r['kernel']:<26} {r['num_warps']:>5} "
                f"{r['shared']:>7} {r['registers']:>4} {r['local']:>5} {r['compile_s']:>5}  "
                f"{'; '.join(r['scenarios'])}{'' if r['fits_shared'] else '  TOO MUCH SHARED MEMORY'}"
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
