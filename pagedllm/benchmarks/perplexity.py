"""`pagedllm bench perplexity`: the quality cost of a weight precision, as perplexity on a fixed
English text (benchmarks/data/perplexity.txt, ~2,000 tokens of prose written for this repo),
pagedllm's own model in each dtype side by side, and transformers on the same directory as the
independent reference.

Both run the same windows: a window of `--window` tokens is one sequence to the model
(positions from 0), windows start every `--stride` tokens, and each scores only the tokens
after the previous window's end, so every token after the first is predicted exactly once,
with at least window - stride tokens of context once the first window is past (the
strided evaluation of transformers' perplexity guide). pagedllm runs its model's forward with
the torch attention backend on a scratch paged KV cache (one request, no past, one prefill),
then `compute_logits` on every scored position; the negative log-likelihood is summed in
float64. Perplexity = exp(mean NLL).
"""

from __future__ import annotations

import argparse
import functools
import os

from pagedllm.benchmarks.common import command_line, machine_info, print_table, write_json
from pagedllm.benchmarks.scoring import (
    hf_window_logits,
    load_pagedllm,
    pagedllm_window_logits,
    perplexity,
    text_ids,
    windows,
)
from pagedllm.models.layers.quantization.registry import METHODS, quantization_choices, takes_group_size

DEFAULT_TEXT = os.path.join(os.path.dirname(__file__), "data", "perplexity.txt")
DTYPES = ("float32", "bfloat16")
QUANTIZATIONS = tuple(quantization_choices())


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="a model name or HF-format directory (default: SmolLM2-135M-Instruct, built on first use)",
    )
    p.add_argument(
        "--dtypes",
        nargs="+",
        default=list(DTYPES),
        choices=DTYPES,
        help="pagedllm's weight / activation dtypes to compare (default: float32 bfloat16)",
    )
    p.add_argument(
        "--hf-dtypes",
        nargs="*",
        default=["float32"],
        choices=DTYPES,
        help="transformers' dtypes, the reference (default: float32; none to skip)",
    )
    p.add_argument(
        "--quantization",
        nargs="*",
        default=[],
        choices=QUANTIZATIONS,
        help="also pagedllm in float32 with these quantized weights: int8, int4, gguf (the "
        "default model's Q4_1 file as it is)",
    )
    p.add_argument(
        "--quantization-group-size",
        type=int,
        default=None,
        help="int4's and int8's group (default 32; int8 -1: per channel)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        default=["auto"],
        choices=["auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"],
        help="pagedllm's KV cache element(s) to compare (default auto: the model's dtype)",
    )
    p.add_argument("--text", default=DEFAULT_TEXT, help="a UTF-8 text file (default: the one shipped)")
    p.add_argument("--max-tokens", type=int, default=None, help="score only the text's first N tokens")
    p.add_argument("--window", type=int, default=1024, help="tokens a forward pass sees (default 1024)")
    p.add_argument("--stride", type=int, default=512, help="tokens between window starts (default 512)")
    p.add_argument(
        "--llama-cpp",
        action="store_true",
        help="with --model FILE.gguf: llama.cpp's llama-perplexity beside pagedllm serving the file, "
        "on llama.cpp's chunks of --window tokens (llama_cpp_perplexity.py; `make llama-cpp`)",
    )
    p.add_argument("--threads", type=int, default=None, help="--llama-cpp: both sides' threads (default: torch's)")
    p.add_argument("--output-json", default=None, metavar="PATH", help="also save the results as JSON")


def run(
    model_dir: str,
    dtypes,
    hf_dtypes,
    text: str,
    max_tokens,
    window: int,
    stride: int,
    quantizations=(),
    group_size=None,
    kv_cache_dtypes=("auto",),
) -> tuple[list[dict], int]:
    """-> (rows: system, dtype, kv_cache_dtype, tokens, nll, perplexity, seconds; the text's token
    count). quantizations: pagedllm float32 rows with those weights ("gguf": the default model's file)."""
    from pagedllm.models.download import resolve_model
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = text_ids(AutoTokenizer.from_pretrained(model_dir), text, max_tokens)
    spans = windows(len(ids), window, stride)
    rows = []
    for dtype in dtypes:
        config, model = load_pagedllm(model_dir, dtype, window)
        for kv in kv_cache_dtypes:
            rows.append(
                {
                    "system": "pagedllm",
                    "dtype": dtype,
                    "kv_cache_dtype": kv,
                    **perplexity(
                        functools.partial(pagedllm_window_logits, config, model, kv_cache_dtype=kv), ids, spans
                    ),
                }
            )
        del model
    for quant in quantizations:
        qdir = str(resolve_model(None, quant)) if METHODS[quant].ready_files else model_dir
        config, model = load_pagedllm(qdir, "float32", window, quant, group_size if takes_group_size(quant) else None)
        rows.append(
            {
                "system": f"pagedllm {quant}",
                "dtype": "float32",
                "kv_cache_dtype": "auto",
                **perplexity(functools.partial(pagedllm_window_logits, config, model), ids, spans),
            }
        )
        del model
    for dtype in hf_dtypes:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        rows.append(
            {
                "system": "transformers",
                "dtype": dtype,
                "kv_cache_dtype": "auto",
                **perplexity(functools.partial(hf_window_logits, hf), ids, spans),
            }
        )
        del hf
    # pagedllm's float32 with its float cache when it ran
    base = next(
        (
            r
            for r in rows
            if r["dtype"] == "float32" and r["kv_cache_dtype"] == "auto" and r["system"] in ("pagedllm", "transformers")
        ),
        None,
    )
    for r in rows:
        r["ratio"] = r["perplexity"] / base["perplexity"] if base else float("nan")
    return rows, len(ids)


def _against_llama_cpp(ns: argparse.Namespace) -> int:
    import torch
    from pagedllm.benchmarks import llama_cpp_perplexity

    if not (ns.model or "").endswith(".gguf"):
        raise ValueError(f"--llama-cpp compares on a GGUF file: --model must be a .gguf file, got {ns.model!r}")
    threads = ns.threads or torch.get_num_threads()
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    got = llama_cpp_perplexity.run(ns.model, ns.text, ns.window, threads)
    machine = machine_info()
    print(f"command: {command_line()}")
    print(f"machine: {machine['cpu']}, {machine['cores']} cores, {threads} threads")
    print(
        f"model: {ns.model}; text: {ns.text} ({got['text_tokens']} tokens; llama-tokenize: "
        f"{got['llama_cpp_tokens']}, ids {'identical' if got['ids_equal'] else 'DIFFERENT'}), "
        f"chunks of {ns.window}, the second half of each scored"
    )
    print()
    print_table(
        got["rows"],
        [
            ("system", "system", ""),
            ("tokens", "scored tokens", "d"),
            ("perplexity", "perplexity", ".4f"),
            ("error", "+/-", ".4f"),
            ("ratio", "ratio to llama.cpp", ".4f"),
        ],
    )
    if ns.output_json:
        write_json(
            ns.output_json,
            {
                "command": command_line(),
                "machine": machine,
                "settings": {k: v for k, v in vars(ns).items() if k != "func"},
                **got,
            },
        )
    return 0


def main(ns: argparse.Namespace) -> int:
    from pagedllm.models.download import ensure_default_model, resolve_model

    if ns.max_tokens is not None and ns.max_tokens < 2:
        raise ValueError(f"--max-tokens must be >= 2, got {ns.max_tokens}")
    if ns.llama_cpp:
        return _against_llama_cpp(ns)
    # a name (a ready model, random:<shape>) as --model takes it elsewhere, or a directory
    model_dir = str(resolve_model(ns.model)) if ns.model else str(ensure_default_model(progress=True))
    machine = machine_info()
    print(f"command: {command_line()}")
    print(
        f"machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']} "
        f"with {machine['torch_threads']} threads"
    )
    rows, n = run(
        model_dir,
        ns.dtypes,
        ns.hf_dtypes or [],
        ns.text,
        ns.max_tokens,
        ns.window,
        ns.stride,
        ns.quantization,
        ns.quantization_group_size,
        ns.kv_cache_dtype,
    )
    print(f"model: {model_dir}; text: {ns.text} ({n} tokens), window {ns.window}, stride {ns.stride}")
    print()
    print_table(
        rows,
        [
            ("system", "system", ""),
            ("dtype", "dtype", ""),
            ("kv_cache_dtype", "KV cache", ""),
            ("tokens", "tokens", "d"),
            ("nll", "mean NLL", ".5f"),
            ("perplexity", "perplexity", ".4f"),
            ("ratio", "ratio to float32", ".4f"),
            ("seconds", "s", ".1f"),
        ],
    )
    ours = {r["dtype"]: r for r in rows if r["system"] == "pagedllm" and r["kv_cache_dtype"] == "auto"}
    for r in rows:
        if r["system"] == "transformers" and r["dtype"] in ours:
            rel = ours[r["dtype"]]["perplexity"] / r["perplexity"] - 1
            print(f"pagedllm / transformers {r['dtype']} perplexity: {rel:+.2e} relative")
    if ns.output_json:
        write_json(
            ns.output_json,
            {
                "command": command_line(),
                "machine": machine,
                "settings": {k: v for k, v in vars(ns).items() if k != "func"},
                "text_tokens": n,
                "results": rows,
            },
        )
    return 0
