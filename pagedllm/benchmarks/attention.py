"""`pagedllm bench attention`: the decode attention kernel's achieved memory bandwidth beside
the device's measured copy rate, in one run.

A decode step's attention reads every cached K and V of its requests once: at batch B,
context L, Hkv KV heads of head_dim D, 2 * B * L * Hkv * D elements, plus the queries, the
outputs and the block table (counted too, though small). bandwidth = those bytes / kernel time.
The reference is `dst.copy_(src)` of a large buffer on the same device (bytes read + written
/ time), the rate a streaming kernel can hope for. The kernel is Triton's unified attention
(split-K chosen as in serving, or --num-splits) on a GPU, the C++ paged decode kernel on the
CPU. Shapes default to Llama-3.2-1B's attention (32 query heads, 8 KV heads, head_dim 64).

--layers N reads N layers' caches in turn, as a model's step does: one layer's cache may sit in
the CPU's last-level cache across calls (SmolLM2 at batch 64, context 256: 12 MiB), where a step's
30 layers come from DRAM, at half the rate or less.

--cuda-graph captures GRAPH_CALLS calls of the kernel(s) in one CUDA graph and times its
replays, as the engine's decode graphs run them: Python's launch overhead (~tens of µs a call,
which at batch 1 is most of an eager call's time) is not charged to the kernel.
"""

from __future__ import annotations

import argparse
import time

from pagedllm.benchmarks.common import command_line, machine_info, print_table, write_json


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="cache dtype (default auto: bfloat16 on cuda, float32 on cpu)",
    )
    p.add_argument(
        "--query-dtype",
        default=None,
        choices=["float32"],
        help="the queries' dtype where it is not the cache's (CPU: float32 over a bfloat16 cache, "
        "as --kv-cache-dtype bfloat16 under a float32 model)",
    )
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--context-len", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="time the kernel replayed from a captured CUDA graph (no launch overhead)",
    )
    p.add_argument(
        "--num-splits",
        type=int,
        nargs="+",
        default=[0],
        help="GPU: split-K counts to time (0: the engine's choice; several: one row each)",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=1,
        help="caches of this many layers, read in turn each timed call (as a model's step reads "
        "them: 30 SmolLM2 layers outgrow the CPU's last-level cache, one layer's may fit it); the "
        "time is per layer",
    )
    p.add_argument("--iters", type=int, default=0, help="timed calls per shape (default: ~0.2 s worth)")
    p.add_argument("--output-json", default=None, metavar="PATH")


def _timer(torch, device):
    """fn, n -> seconds per call (CUDA events on a GPU)."""

    def run(fn, n):
        fn()  # warm-up (compilation, first-touch)
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3 / n
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n

    return run


GRAPH_CALLS = 20  # kernel calls captured in one graph (one replay's launch cost is shared by them)


def graphed(torch, fn):
    """fn's kernels captured GRAPH_CALLS times in one CUDA graph -> (replay, calls per replay)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as torch's docs ask
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    return graph.replay, GRAPH_CALLS


def _iters(timed, fn, requested: int) -> int:
    if requested:
        return requested
    once = max(timed(fn, 1), 1e-6)
    return max(3, min(1000, int(0.2 / once)))


def copy_rate(torch, device, dtype, timed, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy (each byte read once and written once)."""
    n = nbytes // torch.empty((), dtype=dtype).element_size()
    src, dst = torch.ones(n, dtype=dtype, device=device), torch.empty(n, dtype=dtype, device=device)
    fn = lambda: dst.copy_(src)  # noqa: E731
    return 2 * nbytes / timed(fn, _iters(timed, fn, 0))


def decode_case(torch, device, dtype, B, L, H, Hkv, D, bs, seed=0, num_splits=None, q_dtype=None):
    """Random caches holding B requests of context L in shuffled blocks -> (fn, bytes read+written,
    kernel name). num_splits: the Triton kernel's split-K count (None: the engine's choice);
    q_dtype: the queries' and outputs' (None: the cache's)."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-L // bs)
    num_blocks = 1 + B * nb
    block_table = (torch.randperm(num_blocks - 1, generator=g)[: B * nb] + 1).view(B, nb).to(torch.int32)
    k_cache = torch.randn(num_blocks * bs, Hkv, D, generator=g).to(device=device, dtype=dtype)
    v_cache = torch.randn(num_blocks * bs, Hkv, D, generator=g).to(device=device, dtype=dtype)
    q = torch.randn(B, H, D, generator=g).to(device=device, dtype=q_dtype or dtype)
    seq_lens = torch.full((B,), L, dtype=torch.int32)
    moved = 2 * B * L * Hkv * D * k_cache.element_size() + 2 * q.numel() * q.element_size() + block_table.numel() * 4
    scale = D**-0.5
    if device.type == "cuda":
        from pagedllm.attention.backends.triton_attn import paged_attention as tb

        qsl = torch.arange(B + 1, dtype=torch.int32, device=device)
        bt, sl = block_table.to(device), seq_lens.to(device)
        out = torch.empty_like(q)
        fn = lambda: tb.unified_attention(  # noqa: E731
            q,
            k_cache,
            v_cache,
            qsl,
            sl,
            bt,
            bs,
            scale,
            out=out,
            max_query_len=1,
            max_seq_len=L,
            num_splits=num_splits,
        )
        return fn, moved, "triton unified_attention"
    from pagedllm.attention.backends.cpu_attn.kernels import cpu_decode_supported, decode_kernel

    if not cpu_decode_supported(dtype):
        raise ValueError(f"the CPU decode kernel does not take dtype {dtype}; use --dtype float32")
    kernel = decode_kernel()
    fn = lambda: kernel(q, k_cache, v_cache, block_table, seq_lens, bs, scale, 0)  # noqa: E731
    return fn, moved, "C++ paged_decode"


def engine_num_splits(device, B: int, Hkv: int, L: int) -> int:
    """The split-K count the engine chooses for an all-decode batch (1: the CPU kernel's)."""
    if device.type != "cuda":
        return 1
    from pagedllm.attention.backends.triton_attn import paged_attention as tb

    return tb.choose_num_splits(B, Hkv, 1, L, tb.num_sms(device))


def main(ns: argparse.Namespace) -> int:
    import torch

    for name in ("num_heads", "num_kv_heads", "head_dim", "block_size", "layers"):
        if getattr(ns, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(ns, name)}")
    if ns.num_heads % ns.num_kv_heads:
        raise ValueError(f"num_heads ({ns.num_heads}) must be a multiple of num_kv_heads ({ns.num_kv_heads})")
    for v in ns.batch_size + ns.context_len:
        if v < 1:
            raise ValueError(f"batch sizes and context lengths must be >= 1, got {v}")
    if any(n < 0 for n in ns.num_splits):
        raise ValueError(f"--num-splits must be >= 0 (0: the engine's choice), got {ns.num_splits}")
    from pagedllm.engine.arg_utils import resolve_device

    device = torch.device(resolve_device(ns.device))
    if device.type != "cuda" and (ns.cuda_graph or ns.num_splits != [0]):
        raise ValueError("--cuda-graph and --num-splits need device cuda (the Triton kernel)")
    dtype = getattr(torch, ns.dtype if ns.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32"))
    q_dtype = getattr(torch, ns.query_dtype) if ns.query_dtype else None
    if q_dtype is not None and (device.type != "cpu" or dtype != torch.bfloat16):
        raise ValueError("--query-dtype float32 reads a bfloat16 cache (--dtype bfloat16) on the CPU")
    timed = _timer(torch, device)
    machine = machine_info()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else machine["cpu"]
    copy_bytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    peak = copy_rate(torch, device, dtype, timed, copy_bytes)
    rows = []
    for B in ns.batch_size:
        for L in ns.context_len:
            for n in ns.num_splits:
                splits = n or engine_num_splits(device, B, ns.num_kv_heads, L)
                layers = [
                    decode_case(
                        torch,
                        device,
                        dtype,
                        B,
                        L,
                        ns.num_heads,
                        ns.num_kv_heads,
                        ns.head_dim,
                        ns.block_size,
                        seed=i,
                        num_splits=splits,
                        q_dtype=q_dtype,
                    )
                    for i in range(ns.layers)
                ]
                (_, moved, kernel), fns = layers[0], [case[0] for case in layers]
                fn = fns[0] if len(fns) == 1 else lambda fns=fns: [f() for f in fns]  # noqa: E731
                calls = len(fns)
                if ns.cuda_graph:
                    fn, replays = graphed(torch, fn)
                    calls *= replays
                sec = timed(fn, _iters(timed, fn, ns.iters)) / calls
                rows.append(
                    {
                        "batch": B,
                        "context": L,
                        "splits": splits,
                        "kv_mib": moved / 2**20,
                        "us": sec * 1e6,
                        "gbps": moved / sec / 1e9,
                        "pct_of_copy": 100 * moved / sec / peak,
                    }
                )
    print(f"command: {command_line()}")
    print(
        f"device: {name}; torch {machine['torch']}, {machine['torch_threads']} threads; "
        f"kernel: {kernel}; {str(dtype).removeprefix('torch.')}"
        f"{f' (queries {ns.query_dtype})' if q_dtype else ''}; heads {ns.num_heads}/{ns.num_kv_heads}, "
        f"head_dim {ns.head_dim}, block_size {ns.block_size}; {ns.layers} layer(s) in turn; "
        f"{f'CUDA graph replays ({GRAPH_CALLS} calls each)' if ns.cuda_graph else 'eager launches'}"
    )
    print(f"copy rate (dst.copy_(src), {copy_bytes >> 20} MiB, read + write): {peak / 1e9:.1f} GB/s\n")
    print_table(
        rows,
        [
            ("batch", "batch", "d"),
            ("context", "context", "d"),
            ("splits", "splits", "d"),
            ("kv_mib", "MiB moved", ".1f"),
            ("us", "µs / call", ".1f"),
            ("gbps", "GB/s", ".1f"),
            ("pct_of_copy", "% of copy rate", ".1f"),
        ],
    )
    if ns.output_json:
        write_json(
            ns.output_json,
            {
                "command": command_line(),
                "device": name,
                "kernel": kernel,
                "dtype": str(dtype),
                "query_dtype": str(q_dtype or dtype),
                "cuda_graph": ns.cuda_graph,
                "layers": ns.layers,
                "copy_gbps": peak / 1e9,
                "results": rows,
            },
        )
    return 0
