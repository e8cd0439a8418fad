"""`pagedllm bench latency`: time to first token and time per output token of a batch of
B requests (B = 1, 64, ...), a per-phase step profile (`--profile`), vLLM's CPU build on the
same prompts (`--against vllm`, against/latency.py), and llama.cpp on the same weights and
threads: its own tools on a GGUF file (`--llama-cpp FILE.gguf`, llama_cpp_compare.py) or, at
batch 1, llama-cpp-python on the default model's GGUF (`--llama-cpp f32 bf16 q4_1`).

pagedllm runs through LLMEngine with streaming outputs (what the server does), one
`step()` at a time, so that prefill steps and decode steps are timed apart.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

from pagedllm.benchmarks.against.cli_args import add_against_args
from pagedllm.benchmarks.common import (
    command_line,
    machine_info,
    print_profile,
    print_table,
    random_requests,
    write_json,
)
from pagedllm.models.layers.quantization.registry import quantization_choices, takes_group_size


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 64])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--dataset-seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="print where a step's time goes, phase by phase")
    p.add_argument(
        "--llama-cpp",
        nargs="+",
        default=None,
        metavar="FILE|PRECISION",
        help="FILE.gguf: llama.cpp's own llama-bench and llama-batched-bench on that file (give "
        "the --model file) beside the engine's batch-1 decode, prefills and batch-16 decode, "
        "per --threads (instead of the --batch-size runs; `make llama-cpp` builds the tools). "
        "PRECISION: llama-cpp-python at batch 1 on the default model's GGUF: f32 (the same "
        "weights as pagedllm's, dequantised), bf16 (those rounded to bfloat16, as pagedllm's "
        "--dtype bfloat16 rounds them) and/or q4_1 (the file as shipped)",
    )
    p.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=None,
        help="--llama-cpp FILE: the thread counts, each run by both sides in turn (default: torch's)",
    )
    p.add_argument(
        "--llama-cpp-prefill",
        type=int,
        nargs="+",
        default=[128, 512],
        metavar="TOKENS",
        help="--llama-cpp FILE: prompt lengths timed as prefill; the first is also the decode "
        "runs' prompt (default: 128 512)",
    )
    p.add_argument("--llama-cpp-batch", type=int, default=16, help="--llama-cpp FILE: the batched decode's batch")
    p.add_argument(
        "--llama-cpp-repetitions",
        type=int,
        default=3,
        help="--llama-cpp FILE: llama-bench's repetitions (-r) after its warm-up run",
    )
    p.add_argument(
        "--compare-quantization",
        nargs="+",
        default=None,
        metavar="QUANT",
        choices=["none", *quantization_choices()],
        help="run the same batches again with these --quantization values (none: float "
        "weights), side by side with the first engine's",
    )
    p.add_argument(
        "--compare-enforce-eager",
        action="store_true",
        help="GPU: run the same batches again with --enforce-eager (no CUDA graphs)",
    )
    p.add_argument(
        "--compare-async-scheduling",
        action="store_true",
        help="run the same batches again with --async-scheduling toggled (on if it was off, off if on), side by side",
    )
    p.add_argument(
        "--torch-profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="also run torch.profiler over STEPS decode steps of one request (kernels "
        "inside CUDA graphs included) and print the kernels by device time",
    )
    p.add_argument(
        "--torch-profile-batch",
        type=int,
        default=1,
        metavar="B",
        help="--torch-profile's decode steps run B requests (the first B prompts of the "
        "largest --batch-size; default 1)",
    )
    add_against_args(p, "instead of the runs above: TPOT / TTFT of each --batch-size against ")
    p.add_argument("--output-json", default=None, metavar="PATH", help="also save the results as JSON")
    p.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="also draw pagedllm's TTFT / TPOT percentiles and output tok/s against the batch size",
    )


def _weight_mb(engine) -> float:
    """MB of the model's weights as held (quantized or not), where it runs in this process."""
    from pagedllm.models.layers.quantization.layouts import weight_bytes

    worker = getattr(engine.core.model_executor, "driver_worker", None)
    return weight_bytes(worker.model_runner.model) / 1e6 if worker is not None else float("nan")


def run_pagedllm(llm, prompts: list[list[int]], output_len: int, profile: bool) -> dict:
    """One batch through the engine, step by step -> TTFT, decode time per step, profile."""
    import numpy as np
    from pagedllm.engine.output_processor import OutputKind
    from pagedllm.profiler import PROFILER, summarize
    from pagedllm.sampling_params import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"lat-{len(prompts)}-{i}", {"prompt_token_ids": p}, params, kind=OutputKind.DELTA)
    if profile:
        PROFILER.start()
    step_times, first_token, produced, ttfts = [], None, 0, {}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        ts = time.perf_counter()
        outs = engine.step()
        step_times.append(time.perf_counter() - ts)
        produced += sum(len(o.outputs[0].token_ids) for o in outs)
        for o in outs:  # each request's own time to first token
            ttfts.setdefault(o.request_id, time.perf_counter() - t0)
        if first_token is None and produced >= len(prompts):
            first_token = time.perf_counter() - t0  # every request has its first token
            decode_from = len(step_times)
    total = time.perf_counter() - t0
    steps = PROFILER.stop() if profile else []
    decode_steps = step_times[decode_from:]
    row = {
        "system": "pagedllm",
        "batch": len(prompts),
        "ttft_s": first_token,
        "total_s": total,
        "output_tokens": produced,
        "tpot_ms": 1e3 * sum(decode_steps) / max(len(decode_steps), 1),
        "decode_tok_s": len(prompts) * len(decode_steps) / max(sum(decode_steps), 1e-9),
        "output_tok_s": produced / total,
        "weight_mb": _weight_mb(engine),
    }
    # Percentiles over the requests (TTFT) and over the decode steps (TPOT), for --plot.
    for q in (50, 90, 99):
        row[f"p{q}_ttft_ms"] = 1e3 * float(np.percentile(list(ttfts.values()), q))
        row[f"p{q}_tpot_ms"] = 1e3 * float(np.percentile(decode_steps, q)) if decode_steps else float("nan")
    if profile:
        row["profile_decode"] = summarize([s for s in steps if s["num_tokens"] == s["num_reqs"]])
        row["profile_all"] = summarize(steps)
    return row


def torch_profile(llm, prompts: list[list[int]], steps: int, top: int = 30) -> dict:
    """torch.profiler over `steps` decode steps of len(prompts) requests, after their prefill and
    a few warm-up steps -> {"table": kernels by device time, "device_us_per_step", "wall_us_per_step"}."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from pagedllm.sampling_params import SamplingParams

    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(
            f"torch-profile-{i}",
            {"prompt_token_ids": prompt},
            SamplingParams(temperature=0, max_tokens=steps + 16, ignore_eos=True),
        )
    while engine.core.scheduler.waiting:
        engine.step()  # every prefill
    for _ in range(5):  # warm decode steps
        engine.step()
    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    while engine.has_unfinished_requests():
        engine.step()
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    device_us = sum(getattr(e, key) for e in events if not cuda or e.device_type == torch.autograd.DeviceType.CUDA)
    return {
        "table": events.table(sort_by=key, row_limit=top),
        "steps": steps,
        "batch": len(prompts),
        "device_us_per_step": device_us / steps,
        "wall_us_per_step": 1e6 * wall / steps,
    }


LLAMA_CPP_PRECISIONS = ("f32", "bf16", "q4_1")


def split_llama_cpp(values) -> tuple[list[str], list[str]]:
    """--llama-cpp's values -> (GGUF files for llama.cpp's tools, llama-cpp-python precisions)."""
    files, precisions = [], []
    for v in values or ():
        if v in LLAMA_CPP_PRECISIONS:
            precisions.append(v)
        elif v.endswith(".gguf"):
            if not os.path.isfile(v):
                raise ValueError(f"--llama-cpp file {v!r} does not exist")
            files.append(v)
        else:
            raise ValueError(f"--llama-cpp takes a .gguf file or one of {', '.join(LLAMA_CPP_PRECISIONS)}, got {v!r}")
    return files, precisions


# --llama-cpp precision -> (the file name's type, llama.cpp's file type: ALL_F32 = 0,
# MOSTLY_BF16 = 32, which keeps 1-D tensors such as the norms in float32)
_LLAMA_FTYPES = {"f32": ("F32", "LLAMA_FTYPE_ALL_F32"), "bf16": ("BF16", "LLAMA_FTYPE_MOSTLY_BF16")}


def _gguf(precision: str) -> str:
    """The shipped Q4_1 file, or a copy of it made once with llama.cpp's own quantize tool:
    F32 (dequantised: the same numbers pagedllm's float32 model directory holds) or BF16 (those
    rounded to nearest even, as torch's cast to bfloat16 does)."""
    from pagedllm.models.download import find_gguf, pagedllm_home

    src = str(find_gguf())
    if precision == "q4_1":
        return src
    if precision not in _LLAMA_FTYPES:
        raise ValueError(f"--llama-cpp precision must be one of f32, bf16, q4_1, got {precision!r}")
    import llama_cpp

    name, ftype = _LLAMA_FTYPES[precision]
    out = os.path.join(pagedllm_home(), "bench", os.path.basename(src).replace("Q4_1", name))
    if not os.path.exists(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, ftype)
        params.allow_requantize = True
        tmp = out + ".tmp"
        if llama_cpp.llama_model_quantize(src.encode(), tmp.encode(), params) != 0:
            raise RuntimeError(f"llama.cpp could not write {out}")
        os.replace(tmp, out)
    return out


def run_llama_cpp(precision: str, prompt: list[int], output_len: int, threads: int) -> dict:
    """Greedy single stream: the prompt in one eval, then one eval per new token (EOS ignored)."""
    import llama_cpp
    import numpy as np

    path = _gguf(precision)
    llm = llama_cpp.Llama(
        model_path=path,
        n_ctx=len(prompt) + output_len + 16,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    n_vocab = llm.n_vocab()

    def next_token() -> int:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        return int(logits.argmax())

    for _ in range(2):  # the first pass warms up; the second is timed
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        tok = next_token()
        ttft = time.perf_counter() - t0
        tokens = [tok]
        for _ in range(output_len - 1):
            llm.eval([tok])
            tok = next_token()
            tokens.append(tok)
        total = time.perf_counter() - t0
    decode = total - ttft
    return {
        "system": f"llama.cpp {precision}",
        "batch": 1,
        "ttft_s": ttft,
        "total_s": total,
        "output_tokens": len(tokens),
        "tpot_ms": 1e3 * decode / (output_len - 1),
        "decode_tok_s": (output_len - 1) / decode,
        "output_tok_s": len(tokens) / total,
        "token_ids": tokens,
        "weight_mb": os.path.getsize(path) / 1e6,
    }


EAGER = "pagedllm --enforce-eager"


def _variant_rows(eargs, batches: dict, ns, label: str, **changes) -> list[dict]:
    """The same batches through an engine with `changes` to its args (the caller has freed the
    first engine: both would not fit a GPU's memory at gpu_memory_utilization 0.9)."""
    import dataclasses

    from pagedllm.entrypoints.llm import LLM

    llm = LLM(**vars(dataclasses.replace(eargs, **changes)))
    rows = []
    for b, prompts in batches.items():
        print(f"running {label} at batch {b} ...", file=sys.stderr, flush=True)
        rows.append({**run_pagedllm(llm, prompts, ns.output_len, ns.profile), "system": label})
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    return rows


def _free(llm) -> None:
    """Let the next engine have the device's memory: its runner's graphs, weights and caches are
    dropped by hand, as a caller's frame (or the profiler) may still hold the engine itself."""
    import torch

    if llm is not None:
        llm.llm_engine.shutdown()
        runner = getattr(getattr(llm.llm_engine.core.model_executor, "driver_worker", None), "model_runner", None)
        if runner is not None:
            runner.graphs = runner.model = None
            runner.kv_caches, runner.cpu_caches = [], []
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _quantization_rows(eargs, batches: dict, ns) -> list[dict]:
    """The same batches through an engine per --compare-quantization value, one at a time."""
    rows = []
    for quant in ns.compare_quantization:
        q = None if quant == "none" else quant
        rows += _variant_rows(
            eargs,
            batches,
            ns,
            f"pagedllm {q}" if q else "pagedllm",
            quantization=q,
            quantization_group_size=eargs.quantization_group_size if takes_group_size(q) else None,
        )
    return rows


def _against_llama_cpp(llm, tok, files: list[str], ns) -> int:
    """--llama-cpp FILE: the comparison table per file (llama_cpp_compare.py)."""
    import torch
    from pagedllm.benchmarks.llama_cpp_compare import compare, print_comparison

    threads = ns.threads or [torch.get_num_threads()]
    for name, values in (
        ("threads", threads),
        ("llama_cpp_prefill", ns.llama_cpp_prefill),
        ("llama_cpp_batch", [ns.llama_cpp_batch]),
        ("llama_cpp_repetitions", [ns.llama_cpp_repetitions]),
        ("repeat", [ns.repeat]),
    ):
        if min(values) < 1:
            raise ValueError(f"{name} must be >= 1, got {values}")
    results = {}
    for path in files:
        rows = compare(
            llm,
            tok,
            run_pagedllm,
            path,
            threads,
            ns.llama_cpp_prefill,
            ns.output_len,
            ns.llama_cpp_batch,
            ns.llama_cpp_repetitions,
            ns.dataset_seed,
            ns.repeat,
        )
        print_comparison(rows, path)
        results[path] = rows
    if ns.output_json:
        write_json(
            ns.output_json,
            {
                "command": command_line(),
                "machine": machine_info(),
                "settings": {k: v for k, v in vars(ns).items() if k != "func"},
                "against_llama_cpp": results,
            },
        )
    return 0


def main(ns: argparse.Namespace) -> int:
    if ns.against:
        from pagedllm.benchmarks.against.latency import main as against_main

        return against_main(ns)
    import torch
    from pagedllm.entrypoints.cli import engine_args_from
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    for name, v in (
        ("input_len", ns.input_len),
        ("output_len", ns.output_len),
        *(("batch_size", b) for b in ns.batch_size),
    ):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    llama_files, llama_precisions = split_llama_cpp(ns.llama_cpp)
    eargs = engine_args_from(ns)
    if ns.compare_quantization and (ns.compare_enforce_eager or ns.torch_profile):
        raise ValueError("--compare-quantization runs on the CPU: not with --compare-enforce-eager or --torch-profile")
    if max(ns.batch_size) > eargs.max_num_seqs:
        raise ValueError(f"batch_size {max(ns.batch_size)} exceeds --max-num-seqs {eargs.max_num_seqs}")
    llm = LLM(**vars(eargs))
    if ns.compare_enforce_eager and llm.llm_engine.config.device_config.device != "cuda":
        raise ValueError("--compare-enforce-eager needs device cuda: CUDA graphs exist only there")
    tok = llm.get_tokenizer()
    machine = machine_info()
    print(f"command: {command_line()}")
    print(
        f"machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']} "
        f"with {machine['torch_threads']} threads"
    )
    print(
        f"model: {llm.llm_engine.config.model_config.model} (dtype {ns.dtype}), "
        f"input {ns.input_len} tokens, output {ns.output_len} tokens, greedy, ignore_eos"
    )
    core = llm.llm_engine.core
    print(
        f"KV cache: {eargs.kv_cache_dtype}, {core.model_executor.kv_bytes_per_block() // eargs.block_size} "
        f"bytes per token, {core.num_blocks} blocks"
    )
    warm = [[tok.eos_token_id or 0] * 8]
    llm.generate([{"prompt_token_ids": p} for p in warm], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    if llama_files:
        return _against_llama_cpp(llm, tok, llama_files, ns)
    batches = {
        b: [
            r.prompt_token_ids
            for r in random_requests(
                tok, b, (ns.input_len, ns.input_len), (ns.output_len, ns.output_len), ns.dataset_seed + b
            )
        ]
        for b in ns.batch_size
    }
    rows = []
    label = f"pagedllm {eargs.quantization}" if eargs.quantization else "pagedllm"
    if eargs.async_scheduling:
        label += " --async-scheduling"
    for b, prompts in batches.items():
        print(f"running {label} at batch {b} ...", file=sys.stderr, flush=True)
        rows.append({**run_pagedllm(llm, prompts, ns.output_len, ns.profile), "system": label})
    if ns.compare_quantization:
        del llm
        rows += _quantization_rows(eargs, batches, ns)
        llm = None
    profiled = None
    if ns.torch_profile:
        b = ns.torch_profile_batch
        if not 1 <= b <= max(batches):
            raise ValueError(f"torch_profile_batch must be in [1, {max(batches)}] (the largest --batch-size), got {b}")
        print(f"running torch.profiler at batch {b} ...", file=sys.stderr, flush=True)
        profiled = torch_profile(llm, batches[max(batches)][:b], ns.torch_profile)
    if ns.compare_enforce_eager or ns.compare_async_scheduling:
        _free(llm)
        llm = None
    # The toggled engine's label: the first one's with --async-scheduling added or taken away.
    async_label = label.removesuffix(" --async-scheduling") if eargs.async_scheduling else label + " --async-scheduling"
    if ns.compare_async_scheduling:
        rows += _variant_rows(eargs, batches, ns, async_label, async_scheduling=not eargs.async_scheduling)
    if ns.compare_enforce_eager:
        rows += _variant_rows(eargs, batches, ns, EAGER, enforce_eager=True)
    if llama_precisions:
        prompt = random_requests(
            tok, 1, (ns.input_len, ns.input_len), (ns.output_len, ns.output_len), ns.dataset_seed + 1
        )[0].prompt_token_ids
        del llm
        for precision in llama_precisions:
            print(f"running llama.cpp ({precision}) at batch 1 ...", file=sys.stderr, flush=True)
            rows.append(run_llama_cpp(precision, prompt, ns.output_len, torch.get_num_threads()))
    print()
    print_table(
        rows,
        [
            ("system", "system", ""),
            ("batch", "batch", "d"),
            ("ttft_s", "TTFT s", ".3f"),
            ("tpot_ms", "TPOT ms", ".2f"),
            ("decode_tok_s", "decode tok/s", ".1f"),
            ("output_tok_s", "output tok/s (incl. prefill)", ".1f"),
            ("total_s", "total s", ".2f"),
            ("weight_mb", "weights MB", ".0f"),
        ],
    )
    for base in (r for r in rows if r["system"].startswith("pagedllm") and r["batch"] == 1):
        for r in rows:
            if r["system"].startswith("llama.cpp"):
                print(
                    f"{base['system']} / {r['system']} single-stream decode: "
                    f"{base['decode_tok_s'] / r['decode_tok_s']:.2f}x"
                )
    for r in rows:
        base = next((g for g in rows if g["system"] == label and g["batch"] == r["batch"]), None)
        if r["system"] == EAGER and base is not None:
            print(
                f"batch {r['batch']}: TPOT with CUDA graphs {base['tpot_ms']:.2f} ms, eager "
                f"{r['tpot_ms']:.2f} ms ({r['tpot_ms'] / base['tpot_ms']:.2f}x)"
            )
        if ns.compare_async_scheduling and r["system"] == async_label and base is not None:
            on, off = (base, r) if eargs.async_scheduling else (r, base)
            print(
                f"batch {r['batch']}: TPOT {off['tpot_ms']:.2f} ms without --async-scheduling, "
                f"{on['tpot_ms']:.2f} ms with it ({off['tpot_ms'] / on['tpot_ms']:.2f}x)"
            )
    if ns.profile:
        for r in rows:
            if "profile_decode" in r:
                print_profile(f"batch {r['batch']}, decode steps", r["profile_decode"])
                print_profile(f"batch {r['batch']}, all steps (prefill included)", r["profile_all"])
    if profiled:
        print(
            f"\ntorch.profiler, {profiled['steps']} decode steps of {profiled['batch']} request(s): "
            f"{profiled['wall_us_per_step']:.0f} µs a step (wall, profiler on), kernels "
            f"{profiled['device_us_per_step']:.0f} µs a step\n{profiled['table']}"
        )
    if ns.output_json:
        write_json(
            ns.output_json,
            {
                "command": command_line(),
                "machine": machine,
                "settings": {k: v for k, v in vars(ns).items() if k != "func"},
                "results": rows,
                "torch_profile": profiled,
            },
        )
    if ns.plot:
        from pagedllm.benchmarks.plot import plot_load

        plot_load(
            [r for r in rows if r["system"] == "pagedllm"],
            "batch",
            "batch size (requests)",
            "output_tok_s",
            ns.plot,
            f"pagedllm bench latency: input {ns.input_len} / output {ns.output_len} tokens, dtype {ns.dtype}",
        )
        print(f"saved {ns.plot}")
    return 0
