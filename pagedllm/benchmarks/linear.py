"""`pagedllm bench linear`: one decoder layer's float linears (default: Llama-3.2-1B's qkv, o,
gate_up and down) through the kernels the CPU path picks between by row count: the
row-streaming `linear_small` on the plain weight (models/cpu_ops.py, up to SMALL_ROWS rows) and
oneDNN's linear on the packed weight (models/layers/cpu_packed_linear.py), at each row count and
thread count, in one process; in bfloat16 also the register-blocked `bf16_pair_linear` over the
pair layout (csrc/bf16_linear.cpp). Where oneDNN has no bfloat16 kernels (no AVX512-BF16),
torch's F.linear stands in its place.

The layer is copied `--copies` times and the copies run in turn, so that the weights come from
memory as a model's layers do, not from the caches; each figure is the fastest of `--passes`
passes over the copies (the least disturbed by other work), as ms a layer, GB/s of weights read
and GFLOP/s. At one thread the time is the thread's CPU time (`time.thread_time`: the kernels run
in the calling thread), which other processes on a shared machine disturb less than wall time.
"""

from __future__ import annotations

import argparse
import time

from pagedllm.benchmarks.common import command_line, machine_info, print_table, write_json

LLAMA_1B_LAYER = [3072, 2048, 2048, 2048, 16384, 2048, 2048, 8192]  # (N, K) of qkv, o, gate_up, down


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shapes",
        nargs="+",
        type=int,
        default=LLAMA_1B_LAYER,
        metavar="N K",
        help="the layer's linears as output / input feature pairs (default: Llama-3.2-1B's qkv, o, gate_up, down)",
    )
    p.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16, 64])
    p.add_argument("--threads", nargs="+", type=int, default=None, help="thread counts (default: torch's)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--copies", type=int, default=6, help="copies of the layer run in turn (past the caches)")
    p.add_argument("--passes", type=int, default=7, help="passes over the copies; the fastest is reported")
    p.add_argument("--output-json", default=None, metavar="PATH", help="also save the results as JSON")


def check_args(ns: argparse.Namespace) -> list[tuple[int, int]]:
    """-> the (N, K) pairs; a ValueError naming the flag otherwise."""
    if len(ns.shapes) % 2 or not ns.shapes:
        raise ValueError(f"shapes must be N K pairs, got {len(ns.shapes)} numbers")
    for name, values in (
        ("shapes", ns.shapes),
        ("rows", ns.rows),
        ("threads", ns.threads or [1]),
        ("copies", [ns.copies]),
        ("passes", [ns.passes]),
    ):
        if min(values) < 1:
            raise ValueError(f"{name} must be >= 1, got {values}")
    return list(zip(ns.shapes[::2], ns.shapes[1::2]))


def _fastest(layers, x_of, kernel, passes: int, clock) -> float:
    """Seconds a layer: the fastest pass over all copies, each linear of each copy once."""
    best = float("inf")
    for _ in range(passes):
        t0 = clock()
        for layer in layers:
            for w, packed, pairs in layer:
                kernel(x_of[w.shape[1]], w, packed, pairs)
        best = min(best, (clock() - t0) / len(layers))
    return best


def main(ns: argparse.Namespace) -> int:
    import torch

    from pagedllm.models.cpu_ops import cpu_ops
    from pagedllm.models.layers.cpu_packed_linear import CPUPackedLinearMethod, packed_linear_supported

    shapes = check_args(ns)
    dtype = getattr(torch, ns.dtype)
    onednn = packed_linear_supported(dtype)
    if not onednn and dtype != torch.bfloat16:
        raise ValueError(f"dtype {ns.dtype}: oneDNN's packed linear is not available here")
    ops = cpu_ops()
    kernels = {}
    if ops is not None:
        kernels["linear_small"] = lambda x, w, p, q: ops.linear_small(x, w, None)
        if dtype == torch.bfloat16:
            kernels["bf16_pair_linear"] = lambda x, w, p, q: ops.bf16_pair_linear(x, q, None)
    if onednn:
        kernels["oneDNN packed"] = lambda x, w, p, q: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
    else:  # no oneDNN bfloat16 kernels on this CPU
        kernels["F.linear"] = lambda x, w, p, q: torch.nn.functional.linear(x, w)
    pairs = ops is not None and dtype == torch.bfloat16
    layers = []
    for _ in range(ns.copies):
        ws = [torch.randn(n, k).to(dtype) for n, k in shapes]  # [N, K] each
        layers.append(
            [
                (
                    w,
                    torch.ops.mkldnn._reorder_linear_weight(w, 128) if onednn else None,
                    ops.bf16_pair_pack(w) if pairs else None,  # [N, K rounded up to even]
                )
                for w in ws
            ]
        )
    weight_bytes = sum(n * k for n, k in shapes) * torch.finfo(dtype).bits // 8
    macs = sum(n * k for n, k in shapes)
    threads = ns.threads or [torch.get_num_threads()]
    machine = machine_info()
    print(f"command: {command_line()}")
    print(f"machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}")
    print(
        f"layer: {' + '.join(f'{n}x{k}' for n, k in shapes)} {ns.dtype} ({weight_bytes / 1e6:.1f} MB), "
        f"{ns.copies} copies, fastest of {ns.passes} passes"
    )
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        clock = time.thread_time if t == 1 else time.perf_counter
        for m in ns.rows:
            x_of = {k: torch.randn(m, k).to(dtype) for _, k in shapes}  # [M, K] the inputs
            for name, kernel in kernels.items():
                if name == "linear_small" and m > CPUPackedLinearMethod.SMALL_ROWS:  # its most on any CPU
                    continue
                s = _fastest(layers, x_of, kernel, ns.passes, clock)
                rows.append(
                    {
                        "threads": t,
                        "rows": m,
                        "kernel": name,
                        "ms": 1e3 * s,
                        "gb_s": weight_bytes / s / 1e9,
                        "gflop_s": 2 * m * macs / s / 1e9,
                    }
                )
    print()
    print_table(
        rows,
        [
            ("threads", "threads", "d"),
            ("rows", "rows", "d"),
            ("kernel", "kernel", ""),
            ("ms", "ms a layer", ".3f"),
            ("gb_s", "GB/s", ".1f"),
            ("gflop_s", "GFLOP/s", ".1f"),
        ],
    )
    base = "oneDNN packed" if onednn else "F.linear"
    for r in rows:
        if r["kernel"] in ("linear_small", "bf16_pair_linear"):
            other = next(
                o for o in rows if o["kernel"] == base and (o["threads"], o["rows"]) == (r["threads"], r["rows"])
            )
            print(
                f"{r['threads']} thread(s), {r['rows']} rows: {r['kernel']} {other['ms'] / r['ms']:.2f}x {base}'s rate"
            )
    if ns.output_json:
        write_json(ns.output_json, {"command": command_line(), "machine": machine, "results": rows})
    return 0
