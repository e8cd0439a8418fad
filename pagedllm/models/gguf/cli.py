"""`pagedllm make-gguf`: a random-weight GGUF file of a real model's shape (random_model.py's
SHAPES), for the llama.cpp comparison without a download."""

from __future__ import annotations

from pagedllm.models.gguf.file_types import FILE_TYPES


def add_make_gguf_parser(sub) -> None:
    from pagedllm.models.random_model import SHAPES

    p = sub.add_parser("make-gguf", help="write a random-weight GGUF file of a real model's shape")
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES), help="the model's shape")
    p.add_argument(
        "--type",
        default="Q4_0",
        choices=FILE_TYPES,
        help="the matrices' GGML type, or a mix as llama-quantize makes (Q4_K_M, Q5_K_M)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="the .gguf file to write")
    p.set_defaults(func=cmd_make_gguf)


def cmd_make_gguf(ns) -> int:
    from pagedllm.models.gguf.writer import write_gguf
    from pagedllm.models.random_model import random_hf_model

    path = write_gguf(random_hf_model(ns.shape, ns.seed), ns.out, ns.type, name=f"random-{ns.shape}")
    print(path)
    return 0
