"""Where the linears of a batch-B decode step of a Llama-shaped GGUF file go: each linear as the
engine holds it (fused qkv and gate_up; layers 0 and the last, their mean times the layer count;
the LM head, the output weight or the tied embedding) through csrc/gguf_linear.cpp, per ISA
build, in the kernel's CPU time (time.process_time: on a shared machine the wall clock counts
the time slices other work takes). Run it with one thread for a per-core figure:

    OMP_NUM_THREADS=1 PYTHONPATH=. python tools/gguf_step_linears.py llama1b.Q4_0.gguf --rows 1 16
"""

from __future__ import annotations

import argparse
import time

LINEARS = {
    "qkv": ("attn_q", "attn_k", "attn_v"),
    "o": ("attn_output",),
    "gate_up": ("ffn_gate", "ffn_up"),
    "down": ("ffn_down",),
}


def _ms(fn, seconds: float) -> float:
    """Median of 3 runs of `seconds` each, CPU ms a call."""
    runs = []
    for _ in range(3):
        fn()
        n, t0 = 0, time.process_time()
        while time.process_time() - t0 < seconds:
            fn()
            n += 1
        runs.append(1e3 * (time.process_time() - t0) / n)
    return sorted(runs)[1]


def main() -> None:
    import gguf
    import numpy as np
    import torch

    from pagedllm.csrc import build
    from pagedllm.models.layers.quantization.gguf_repack import pack_segments

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file")
    p.add_argument("--rows", type=int, nargs="+", default=[1])
    p.add_argument("--isa", nargs="+", default=None, help="builds to time (default: every one this CPU runs)")
    p.add_argument("--seconds", type=float, default=0.3)
    p.add_argument(
        "--activations",
        nargs="+",
        default=["int8"],
        choices=["int8", "int16"],
        help="the kernels' activation codes (PAGEDLLM_GGUF_ACTIVATIONS), each timed in turn",
    )
    ns = p.parse_args()
    tensors = {t.name: t for t in gguf.GGUFReader(ns.file).tensors}
    layers = 1 + max(int(n.split(".")[1]) for n in tensors if n.startswith("blk."))

    def raw(name):
        t = tensors[name]
        return t.tensor_type.name, np.asarray(t.data).reshape(t.data.shape[0], -1)

    # (label, names, times a step); a GGUF shape is [input features, output rows]
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    weights = [
        (f"{lin} L{layer}", [f"blk.{layer}.{part}.weight" for part in parts], layers / 2)
        for lin, parts in LINEARS.items()
        for layer in (0, layers - 1)
    ] + [("lm_head", [head], 1)]
    print(f"{ns.file}: {layers} layers, {torch.get_num_threads()} threads, CPU ms a call")
    for acts in ns.activations:
        packed = [
            (
                label,
                pack_segments([raw(n) for n in names], acts),
                int(tensors[names[0]].shape[0]),
                [tensors[n].tensor_type.name for n in names],
                times,
            )
            for label, names, times in weights
        ]
        for isa in ns.isa or build.runnable_isas():
            ops = build.isa_extension(isa)
            for rows in ns.rows:
                step = {}
                for label, (w, meta), k, types, times in packed:
                    x = torch.randn(rows, k)
                    ms = _ms(lambda: ops.gguf_linear(x, w, meta, None), ns.seconds)
                    step[label.split()[0]] = step.get(label.split()[0], 0.0) + ms * times
                    print(f"{acts} {isa} rows {rows} {label:10s} {'+'.join(types):16s} {ms:8.3f} ms")
                total = sum(step.values())
                print(
                    f"{acts} {isa} rows {rows} a step: "
                    + ", ".join(f"{k} {v:.1f} ms ({100 * v / total:.0f} %)" for k, v in step.items())
                    + f"; linears {total:.1f} ms"
                )


if __name__ == "__main__":
    main()
