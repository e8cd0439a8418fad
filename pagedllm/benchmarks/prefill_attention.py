"""`pagedllm bench prefill-attention`: one layer's attention over a prompt chunk on the CPU, the
C++ paged prefill kernel against the torch path's SDPA, interleaved in one run.

Both are the CPU backend's `paged_attention` (attention/backends/cpu_attn/) on the same step (the chunk's K/V written into
a paged cache with shuffled blocks, then attended), with the metadata of the CPU backend
(`prefill_by_pages`: the kernel reads the pages through the block table and writes the step's
output in place) and of the reference backend (one `F.scaled_dot_product_attention` per chunk,
its past gathered from the slots, its [1, H, q, D] output copied into the step's [T, H, D]).
GFLOP/s counts the causal products only: 4 H D per visible (query, key) pair (QK^T and PV).
Rounds alternate the two so that a shared machine's load falls on both alike; each figure is
the median of its rounds. Head shapes default to SmolLM2-135M's (9 query / 3 KV heads of 64)
and Llama-3.2-1B's (32 / 8 of 64).
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagedllm.benchmarks.common import command_line, machine_info, print_table, write_json


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--prompt-len", type=int, nargs="+", default=[128, 512, 2048], help="new tokens of the chunk (one request)"
    )
    p.add_argument("--past", type=int, default=0, help="tokens already cached before the chunk")
    p.add_argument(
        "--heads",
        nargs="+",
        default=["9/3", "32/8"],
        metavar="H/HKV",
        help="query heads / KV heads, one shape each (default: SmolLM2-135M, Llama-3.2-1B)",
    )
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (median taken)")
    p.add_argument("--threads", type=int, default=0, help="torch / OpenMP threads (default: torch's)")
    p.add_argument("--output-json", default=None, metavar="PATH")


def parse_heads(spec: str) -> tuple[int, int]:
    try:
        H, Hkv = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ValueError(f"--heads takes H/HKV pairs such as 9/3, got {spec!r}") from None
    if H < 1 or Hkv < 1 or H % Hkv:
        raise ValueError(f"--heads {spec}: query heads must be a positive multiple of KV heads")
    return H, Hkv


def prefill_case(torch, dtype, n: int, past: int, H: int, Hkv: int, D: int, bs: int, seed: int = 0):
    """One request's chunk of n tokens over `past` cached ones, in shuffled blocks -> (calls:
    {"kernel": fn, "sdpa": fn}, FLOPs of one call). Each fn runs paged_attention -> [n, H, D]."""
    import numpy as np

    from pagedllm.attention.backends.cpu_attn.paged_attention import paged_attention
    from pagedllm.attention.backends.torch_sdpa.metadata import build_attention_metadata

    g = torch.Generator().manual_seed(seed)
    L = past + n
    nb = -(-L // bs)
    table = (torch.randperm(nb, generator=g) + 1).view(1, nb).to(torch.int32).numpy()
    S = (nb + 1) * bs
    kc = torch.randn(S, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(S, Hkv, D, generator=g).to(dtype)
    q, k, v = (torch.randn(n, h, D, generator=g).to(dtype) for h in (H, Hkv, Hkv))
    pos = np.arange(past, L)
    slots = torch.from_numpy(table[0, pos // bs].astype(np.int64) * bs + pos % bs)
    qsl, seq_lens = np.array([0, n], dtype=np.int32), np.array([L], dtype=np.int32)
    calls = {}
    for name, by_pages in (("sdpa", False), ("kernel", True)):
        meta = build_attention_metadata(
            qsl, seq_lens, table, bs, slots, decode_by_pages=by_pages, prefill_by_pages=by_pages
        )
        calls[name] = (lambda m: lambda: paged_attention(q, k, v, kc, vc, m, D**-0.5))(meta)
    pairs = n * past + n * (n + 1) // 2  # visible (query, key) pairs, causal
    return calls, 4 * H * D * pairs


def time_interleaved(calls: dict, rounds: int) -> dict:
    """Median seconds per call of each fn, its calls alternating with the others' round by round
    (each round ~0.1 s of a fn, at least 1 call)."""
    for fn in calls.values():  # warm-up
        fn()
    reps = {}
    for name, fn in calls.items():
        t0 = time.perf_counter()
        fn()
        reps[name] = max(1, int(0.1 / max(time.perf_counter() - t0, 1e-6)))
    samples = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            for _ in range(reps[name]):
                fn()
            samples[name].append((time.perf_counter() - t0) / reps[name])
    return {name: statistics.median(s) for name, s in samples.items()}


def main(ns: argparse.Namespace) -> int:
    import torch

    from pagedllm.attention.backends.cpu_attn.kernels import prefill_kernel
    from pagedllm.csrc.build import selected_isa

    shapes = [parse_heads(s) for s in ns.heads]
    if ns.threads < 0:
        raise ValueError(f"--threads must be >= 0 (0: torch's default), got {ns.threads}")
    if ns.threads:
        torch.set_num_threads(ns.threads)
    for name in ("head_dim", "block_size", "rounds"):
        if getattr(ns, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(ns, name)}")
    if ns.past < 0 or any(n < 1 for n in ns.prompt_len):
        raise ValueError("--prompt-len must be >= 1 and --past >= 0")
    dtype = getattr(torch, ns.dtype)
    if prefill_kernel(dtype, ns.head_dim) is None:
        raise ValueError(
            f"the C++ prefill kernel is not built or does not take {ns.dtype} with head_dim "
            f"{ns.head_dim} (a multiple of 16)"
        )
    rows = []
    with torch.inference_mode():
        for H, Hkv in shapes:
            for n in ns.prompt_len:
                calls, flops = prefill_case(torch, dtype, n, ns.past, H, Hkv, ns.head_dim, ns.block_size)
                sec = time_interleaved(calls, ns.rounds)
                rows.append(
                    {
                        "heads": f"{H}/{Hkv}",
                        "tokens": n,
                        "sdpa_ms": sec["sdpa"] * 1e3,
                        "kernel_ms": sec["kernel"] * 1e3,
                        "sdpa_gflops": flops / sec["sdpa"] / 1e9,
                        "kernel_gflops": flops / sec["kernel"] / 1e9,
                        "speedup": sec["sdpa"] / sec["kernel"],
                    }
                )
    machine = machine_info()
    print(f"command: {command_line()}")
    print(
        f"cpu: {machine['cpu']}; torch {machine['torch']}, {machine['torch_threads']} threads; kernel build "
        f"{selected_isa()}; {ns.dtype}; head_dim {ns.head_dim}, block_size {ns.block_size}, past {ns.past}; "
        f"median of {ns.rounds} alternating rounds\n"
    )
    print_table(
        rows,
        [
            ("heads", "heads", "s"),
            ("tokens", "tokens", "d"),
            ("sdpa_ms", "SDPA ms", ".2f"),
            ("kernel_ms", "kernel ms", ".2f"),
            ("sdpa_gflops", "SDPA GFLOP/s", ".1f"),
            ("kernel_gflops", "kernel GFLOP/s", ".1f"),
            ("speedup", "SDPA / kernel", ".2f"),
        ],
    )
    if ns.output_json:
        write_json(
            ns.output_json,
            {
                "command": command_line(),
                "cpu": machine["cpu"],
                "isa": selected_isa(),
                "dtype": ns.dtype,
                "past": ns.past,
                "results": rows,
            },
        )
    return 0
