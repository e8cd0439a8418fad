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
import math
import os
import time

from pagedllm.benchmarks.common import command_line, machine_info, print_table, write_json
from pagedllm.models.layers.quantization.registry import METHODS, quantization_choices, takes_group_size

DEFAULT_TEXT = os.path.join(os.path.dirname(__file__), "data", "perplexity.txt")
DTYPES = ("float32", "bfloat16")
QUANTIZATIONS = tuple(quantization_choices())


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a model name or HF-format directory (default: SmolLM2-135M-Instruct, built on first use)")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES,
                   help="pagedllm's weight / activation dtypes to compare (default: float32 bfloat16)")
    p.add_argument("--hf-dtypes", nargs="*", default=["float32"], choices=DTYPES,
                   help="transformers' dtypes, the reference (default: float32; none to skip)")
    p.add_argument("--quantization", nargs="*", default=[], choices=QUANTIZATIONS,
                   help="also pagedllm in float32 with these quantized weights: int8, int4, gguf (the "
                        "default model's Q4_1 file as it is)")
    p.add_argument("--quantization-group-size", type=int, default=None,
                   help="int4's and int8's group (default 32; int8 -1: per channel)")
    p.add_argument("--kv-cache-dtype", nargs="+", default=["auto"],
                   choices=["auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="pagedllm's KV cache element(s) to compare (default auto: the model's dtype)")
    p.add_argument("--text", default=DEFAULT_TEXT, help="a UTF-8 text file (default: the one shipped)")
    p.add_argument("--max-tokens", type=int, default=None, help="score only the text's first N tokens")
    p.add_argument("--window", type=int, default=1024, help="tokens a forward pass sees (default 1024)")
    p.add_argument("--stride", type=int, default=512, help="tokens between window starts (default 512)")
    p.add_argument("--llama-cpp", action="store_true",
                   help="with --model FILE.gguf: llama.cpp's llama-perplexity beside pagedllm serving the file, "
                        "on llama.cpp's chunks of --window tokens (llama_cpp_perplexity.py; `make llama-cpp`)")
    p.add_argument("--threads", type=int, default=None, help="--llama-cpp: both sides' threads (default: torch's)")
    p.add_argument("--output-json", default=None, metavar="PATH", help="also save the results as JSON")


def windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored target) for a text of n tokens: the model sees ids[begin:end]
    and predicts targets ids[first:end], each target from the positions before it."""
    if window < 2 or not (1 <= stride < window):
        raise ValueError(f"need window >= 2 and 1 <= stride < window, got window {window}, stride {stride}")
    if n < 2:
        raise ValueError(f"the text must have at least 2 tokens, got {n}")
    out, prev_end = [], 1
    for begin in range(0, n, stride):
        end = min(begin + window, n)
        if end > prev_end:
            out.append((begin, end, prev_end))
            prev_end = end
        if end == n:
            break
    return out


def nll_sum(logits, targets) -> float:
    """logits [T, V], targets [T] -> the sum of -log softmax(logits)[target], in float64."""
    import torch
    total = 0.0
    for s in range(0, logits.shape[0], 256):   # 256 rows of float64 log-softmax at a time
        lp = torch.log_softmax(logits[s:s + 256].double(), dim=-1)
        total -= float(lp.gather(1, targets[s:s + 256, None]).sum())
    return total


def load_pagedllm(model_dir: str, dtype: str, window: int, quantization=None, group_size=None):
    """pagedllm's model, loaded as the engine loads it (packed or quantized linears, fused ops)."""
    from pagedllm.config import ModelConfig
    from pagedllm.models.loader import load_model
    config = ModelConfig.from_dir(model_dir, dtype=dtype, max_model_len=window)
    config.set_quantization(quantization, group_size, "cpu")
    return config, load_model(config)


def pagedllm_window_logits(config, model, ids: list[int], first: int, kv_cache_dtype: str = "auto"):
    """One window as a single prefill (no past) over a scratch paged KV cache of kv_cache_dtype
    (an int8 / fp8 cache: attention reads every key and value back quantized) -> float32 logits
    [len(ids) - first, V] predicting ids[first:], from positions first-1 .. len(ids)-2."""
    import torch
    from pagedllm.attention.kv_quant import resolve_kv_cache_dtype
    from pagedllm.attention.layer import attention_layers, bind_kv_cache, get_kv_cache_spec
    from pagedllm.forward_context import set_forward_context
    T, bs = len(ids), 16
    nb = -(-T // bs)
    cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, next(model.parameters()).dtype)
    specs = get_kv_cache_spec(model, bs, cache_dtype).values()
    bind_kv_cache(model, [tuple(torch.zeros(shape, dtype=dt) for shape, dt in spec.kv_tensors(nb))
                          for spec in specs])
    backend = next(iter(attention_layers(model).values())).backend
    meta = backend.build_metadata(torch.tensor([0, T], dtype=torch.int32), torch.tensor([T], dtype=torch.int32),
                                  torch.arange(nb, dtype=torch.int32)[None, :], torch.arange(T, dtype=torch.int64), bs)
    with set_forward_context(meta):
        hidden = model(torch.tensor(ids, dtype=torch.int64), torch.arange(T, dtype=torch.int64))
    return torch.cat([model.compute_logits(hidden[s:min(s + 256, T - 1)])
                      for s in range(first - 1, T - 1, 256)])


def hf_window_logits(model, ids: list[int], first: int):
    import torch
    return model(torch.tensor([ids])).logits[0, first - 1:-1].float()


def perplexity(window_logits, ids: list[int], spans: list[tuple[int, int, int]]) -> dict:
    """window_logits(window ids, first target relative to the window) -> logits of its targets."""
    import torch
    total, count = 0.0, 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for begin, end, first in spans:
            logits = window_logits(ids[begin:end], first - begin)
            total += nll_sum(logits, torch.tensor(ids[first:end], dtype=torch.int64))
            count += end - first
    nll = total / count
    return {"tokens": count, "nll": nll, "perplexity": math.exp(nll), "seconds": time.perf_counter() - t0}


def text_ids(tokenizer, path: str, max_tokens: int | None) -> list[int]:
    with open(path, encoding="utf-8") as f:
        ids = tokenizer(f.read())["input_ids"]
    if max_tokens is not None:
        if max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
        ids = ids[:max_tokens]
    return ids


def run(model_dir: str, dtypes, hf_dtypes, text: str, max_tokens, window: int, stride: int,
        quantizations=(), group_size=None, kv_cache_dtypes=("auto",)) -> tuple[list[dict], int]:
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
            rows.append({"system": "pagedllm", "dtype": dtype, "kv_cache_dtype": kv,
                         **perplexity(functools.partial(pagedllm_window_logits, config, model, kv_cache_dtype=kv),
                                     ids, spans)})
        del model
    for quant in quantizations:
        qdir = str(resolve_model(None, quant)) if METHODS[quant].ready_files else model_dir
        config, model = load_pagedllm(qdir, "float32", window, quant, group_size if takes_group_size(quant) else None)
        rows.append({"system": f"pagedllm {quant}", "dtype": "float32", "kv_cache_dtype": "auto",
                     **perplexity(functools.partial(pagedllm_window_logits, config, model), ids, spans)})
        del model
    for dtype in hf_dtypes:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        rows.append({"system": "transformers", "dtype": dtype, "kv_cache_dtype": "auto",
                     **perplexity(functools.partial(hf_window_logits, hf), ids, spans)})
        del hf
    # pagedllm's float32 with its float cache when it ran
    base = next((r for r in rows if r["dtype"] == "float32" and r["kv_cache_dtype"] == "auto"
                 and r["system"] in ("pagedllm", "transformers")), None)
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
    print(f"model: {ns.model}; text: {ns.text} ({got['text_tokens']} tokens; llama-tokenize: "
          f"{got['llama_cpp_tokens']}, ids {'identical' if got['ids_equal'] else 'DIFFERENT'}), "
          f"chunks of {ns.window}, the second half of each scored")
    print()
    print_table(got["rows"], [("system", "system", ""), ("tokens", "scored tokens", "d"),
                              ("perplexity", "perplexity", ".4f"), ("error", "+/-", ".4f"),
                              ("ratio", "ratio to llama.cpp", ".4f")])
    if ns.output_json:
        write_json(ns.output_json, {"command": command_line(), "machine": machine,
                                    "settings": {k: v for k, v in vars(ns).items() if k != "func"}, **got})
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
    print(f"machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']} "
          f"with {machine['torch_threads']} threads")
    rows, n = run(model_dir, ns.dtypes, ns.hf_dtypes or [], ns.text, ns.max_tokens, ns.window, ns.stride,
                  ns.quantization, ns.quantization_group_size, ns.kv_cache_dtype)
    print(f"model: {model_dir}; text: {ns.text} ({n} tokens), window {ns.window}, stride {ns.stride}")
    print()
    print_table(rows, [("system", "system", ""), ("dtype", "dtype", ""), ("kv_cache_dtype", "KV cache", ""),
                       ("tokens", "tokens", "d"),
                       ("nll", "mean NLL", ".5f"), ("perplexity", "perplexity", ".4f"),
                       ("ratio", "ratio to float32", ".4f"), ("seconds", "s", ".1f")])
    ours = {r["dtype"]: r for r in rows if r["system"] == "pagedllm" and r["kv_cache_dtype"] == "auto"}
    for r in rows:
        if r["system"] == "transformers" and r["dtype"] in ours:
            rel = ours[r["dtype"]]["perplexity"] / r["perplexity"] - 1
            print(f"pagedllm / transformers {r['dtype']} perplexity: {rel:+.2e} relative")
    if ns.output_json:
        write_json(ns.output_json, {"command": command_line(), "machine": machine,
                                    "settings": {k: v for k, v in vars(ns).items() if k != "func"},
                                    "text_tokens": n, "results": rows})
    return 0
