"""`pagedllm bench gguf-kernel`: one GGUF weight matrix through csrc/gguf_linear.cpp (the file's
blocks, 16 rows interleaved) against the layout GGUF weights were held in before (int4 in groups
of 32 for 4-bit types, int8 in groups of 32 / 16 for Q8_0 / Q6_K: csrc/quant_ops.cpp's
quant_linear) and torch's float32 matmul, at each row count, in every ISA build the CPU runs,
with int8 and int16 activations (PAGEDLLM_GGUF_ACTIVATIONS: the codes in quads or pairs).
Same process, same threads, the weights' bytes beside each.
"""

from __future__ import annotations

import argparse
import time

from pagedllm.benchmarks.common import command_line, machine_info, print_table, write_json

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--types", nargs="+", default=["Q4_0", "Q8_0", "Q4_K", "Q6_K"], choices=TYPES)
    p.add_argument(
        "--shape",
        nargs=2,
        type=int,
        default=[8192, 2048],
        metavar=("N", "K"),
        help="output x input features (default: Llama-3.2-1B's gate/up projection)",
    )
    p.add_argument("--rows", nargs="+", type=int, default=[1, 8, 16, 128])
    p.add_argument(
        "--activations",
        nargs="+",
        default=["int8", "int16"],
        choices=["int8", "int16"],
        help="the kernels' activation codes (codes in quads / pairs); each measured in turn",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seconds", type=float, default=0.5, help="time per measurement")
    p.add_argument("--output-json", default=None, metavar="PATH")


def _blocks(type_name: str, n: int, k: int, rng):
    """Raw GGUF rows [n, row bytes]: the gguf package's quantizer where it has one, else random
    bytes with float16 scales in range (the kernel's time does not depend on the values)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    qtype = GGMLQuantizationType[type_name]
    try:
        return quantize(rng.standard_normal((n, k), dtype=np.float32) * 0.02, qtype)
    except NotImplementedError:
        block, nbytes = GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (n, k // block, nbytes), dtype=np.uint8)
        at = {"Q4_K": (0, 4), "Q5_K": (0, 4), "Q6_K": (208, 210)}[type_name]
        data[:, :, at[0] : at[1]] = (
            rng.uniform(1e-3, 1e-2, (n, k // block, (at[1] - at[0]) // 2)).astype(np.float16).view(np.uint8)
        )
        return data.reshape(n, -1)


def _old_layout(type_name: str, w):
    """(qweight, scales, mins) as the int4 / int8 layout held this type's values."""
    import torch

    from pagedllm.models.layers.quantization.layouts import quantize_int4, quantize_int8

    if type_name in ("Q4_0", "Q4_1", "Q4_K"):
        return quantize_int4(w, 32)
    q, s = quantize_int8(w, 16 if type_name == "Q6_K" else 32)
    return q, s, torch.empty(0)


def _ms(fn, seconds: float) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return 1e3 * (time.perf_counter() - t0) / n


def main(ns: argparse.Namespace) -> int:
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from pagedllm.csrc import build
    from pagedllm.models.layers.quantization.gguf_repack import pack_segments

    if ns.threads:
        torch.set_num_threads(ns.threads)
    n, k = ns.shape
    machine = machine_info()
    print(f"command: {command_line()}")
    print(
        f"machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']} with "
        f"{torch.get_num_threads()} threads; weight [{n}, {k}]"
    )
    rng = np.random.default_rng(0)
    rows_out = []
    for type_name in ns.types:
        data = _blocks(type_name, n, k, rng)
        w = torch.from_numpy(dequantize(data, GGMLQuantizationType[type_name]).astype(np.float32))
        packed = {a: pack_segments([(type_name, data)], a) for a in ns.activations}
        old = _old_layout(type_name, w)
        old_bytes = sum(t.numel() * t.element_size() for t in old)
        for isa in build.runnable_isas():
            ops = build.isa_extension(isa)
            if ops is None:
                raise RuntimeError(f"the {isa} build of the C++ kernels failed: {build.build_failures}")
            for rows in ns.rows:
                x = torch.randn(rows, k)
                # interleaved: each kernel's time beside the others' on a machine that may be busy
                ms = {a: _ms(lambda a=a: ops.gguf_linear(x, *packed[a], None), ns.seconds) for a in ns.activations}
                before = _ms(lambda: ops.quant_linear(x, *old, None), ns.seconds)
                flt = _ms(lambda: x @ w.T, ns.seconds)
                for a, new in ms.items():
                    rows_out.append(
                        {
                            "type": type_name,
                            "isa": isa,
                            "acts": a,
                            "rows": rows,
                            "gguf_ms": new,
                            "old_ms": before,
                            "float_ms": flt,
                            "speedup_old": before / new,
                            "speedup_float": flt / new,
                            "vs_int16": ms.get("int16", new) / new,
                            "file_mb": data.nbytes / 1e6,
                            "held_mb": packed[a][0].numel() / 1e6,
                            "gb_s": packed[a][0].numel() / 1e6 / new,  # weight bytes read a second
                            "old_mb": old_bytes / 1e6,
                        }
                    )
                print(
                    f"{type_name} {isa} rows {rows}: " + ", ".join(f"{a} {t:.3f} ms" for a, t in ms.items()), flush=True
                )
    print()
    print_table(
        rows_out,
        [
            ("type", "type", ""),
            ("isa", "ISA", ""),
            ("acts", "activations", ""),
            ("rows", "rows", "d"),
            ("gguf_ms", "blocks ms", ".3f"),
            ("gb_s", "blocks GB/s", ".1f"),
            ("old_ms", "int4/int8 layout ms", ".3f"),
            ("float_ms", "float32 mm ms", ".3f"),
            ("speedup_old", "vs layout", ".2f"),
            ("speedup_float", "vs float32", ".2f"),
            ("vs_int16", "vs int16", ".2f"),
            ("file_mb", "file MB", ".1f"),
            ("held_mb", "held MB", ".1f"),
            ("old_mb", "layout MB", ".1f"),
        ],
    )
    if ns.output_json:
        write_json(ns.output_json, {"command": command_line(), "machine": machine, "results": rows_out})
    return 0
