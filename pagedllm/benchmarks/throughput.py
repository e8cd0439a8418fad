"""`pagedllm bench throughput`: offline output-token rate of LLM.generate beside transformers generate.

One fixed random set of requests (ignore_eos, so each produces exactly its output length) runs
first through pagedllm's continuous batching, then through transformers `generate` in static
batches of the same maximum batch size, in one process with the same weights, dtype, threads and
greedy decoding. A static batch runs until its longest member is done; only each request's own
output length counts as useful there, since that waste is what continuous batching removes.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

from pagedllm.benchmarks.against.cli_args import add_against_args
from pagedllm.benchmarks.common import (
    Req,
    add_workload_args,
    command_line,
    machine_info,
    print_table,
    workload_requests,
    write_json,
)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    p.add_argument(
        "--hf-batch-size", type=int, default=None, help="transformers static batch size (default: --max-num-seqs)"
    )
    p.add_argument(
        "--hf-num-prompts",
        type=int,
        default=None,
        help="run transformers on only the first N requests and extrapolate its rate (default: all)",
    )
    p.add_argument("--skip-hf", action="store_true", help="time pagedllm only")
    add_against_args(p, "instead of transformers: ")
    p.add_argument(
        "--profile",
        action="store_true",
        help="--against: also print pagedllm's per-phase step profile of its first timed run",
    )
    p.add_argument(
        "--py-spy",
        default=None,
        metavar="DIR",
        help="--against: py-spy record (raw collapsed stacks) of each engine's first timed run, "
        "all its processes, into DIR/pagedllm.txt and DIR/vllm.txt",
    )
    p.add_argument("--output-json", default=None, metavar="PATH", help="also save the results as JSON")


class _Timer:
    """Wall time, and the CPU time of this process over it (all threads)."""

    def __enter__(self):
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.elapsed = time.perf_counter() - self.t0
        self.cpu = time.process_time() - self.c0


def _row(system, reqs, in_toks, out_toks, timer, **extra) -> dict:
    e = timer.elapsed
    return {
        "system": system,
        "requests": reqs,
        "input_tokens": in_toks,
        "output_tokens": out_toks,
        "elapsed_s": e,
        "output_tok_s": out_toks / e,
        "total_tok_s": (in_toks + out_toks) / e,
        "cores_used": timer.cpu / e,
        **extra,
    }


def run_pagedllm(llm, requests) -> dict:
    from pagedllm.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    # Warm-up (first-call allocations, kernel selection) on a prompt no request starts with, so
    # that a prefix cache cannot give the timed run a head start.
    warm = [{"prompt_token_ids": [r.prompt_token_ids[-1]] * 16} for r in requests[:2]]
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    with _Timer() as t:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return _row(
        "pagedllm",
        len(requests),
        sum(len(o.prompt_token_ids) for o in outs),
        sum(len(o.outputs[0].token_ids) for o in outs),
        t,
    )


def _hf_batch(model, batch, pad_id, torch):
    """Left-padded static batch; min_new_tokens = max_new_tokens masks EOS so no row stops early."""
    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):
        n = len(r.prompt_token_ids)
        ids[i, width - n :] = torch.tensor(r.prompt_token_ids)
        mask[i, width - n :] = 1
    new = max(r.output_len for r in batch)
    ids, mask = ids.to(model.device), mask.to(model.device)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=new,
        min_new_tokens=new,
        eos_token_id=None,
        pad_token_id=pad_id,
    )
    if out.shape[1] - width != new:  # else the useful count below would credit tokens never made
        raise RuntimeError(f"transformers stopped after {out.shape[1] - width} of {new} new tokens")
    return new * len(batch)


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_transformers(model_dir, dtype, tokenizer, requests, batch_size, device) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    generated = 0
    with torch.inference_mode():
        _hf_batch(model, [Req([r.prompt_token_ids[-1]] * 16, 4) for r in requests[:2]], pad_id, torch)  # warm-up
        _sync(torch, model.device)
        with _Timer() as t:
            for k, batch in enumerate(batches):
                generated += _hf_batch(model, batch, pad_id, torch)
                print(
                    f"  transformers: batch {k + 1}/{len(batches)} done, {time.perf_counter() - t.t0:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
            _sync(torch, model.device)
    useful = sum(r.output_len for r in requests)
    return _row(
        "transformers",
        len(requests),
        sum(len(r.prompt_token_ids) for r in requests),
        useful,
        t,
        generated_tokens=generated,
        batch_size=batch_size,
        num_batches=len(batches),
        attn_implementation=getattr(model.config, "_attn_implementation", None),
    )


def main(ns: argparse.Namespace) -> int:
    if ns.against:
        from pagedllm.benchmarks.against.offline import main as against_main

        return against_main(ns)
    import torch
    from pagedllm.entrypoints.cli import engine_args_from
    from pagedllm.entrypoints.llm import LLM

    eargs = engine_args_from(ns)
    hf_bs = ns.hf_batch_size or eargs.max_num_seqs
    for name, v in (("hf_batch_size", hf_bs), ("hf_num_prompts", ns.hf_num_prompts)):
        if v is not None and v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    llm = LLM(**vars(eargs))
    mc = llm.llm_engine.config.model_config
    model_dir = mc.model
    # EngineArgs resolved "auto" (float32 on the CPU, the config's on a GPU); the baseline uses
    # the same dtype on the same device.
    dtype = getattr(torch, mc.dtype)
    device = torch.device(llm.llm_engine.config.device_config.device)
    tokenizer = llm.get_tokenizer()
    requests = workload_requests(tokenizer, ns)
    machine = machine_info()
    print(f"command: {command_line()}")
    print(
        f"machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']} "
        f"with {machine['torch_threads']} threads (both systems)"
    )
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)} (both systems)")
    print(f"model: {model_dir} ({str(dtype).removeprefix('torch.')}, greedy, ignore_eos)")
    print(
        f"requests: {len(requests)}, input {ns.min_input_len}-{ns.max_input_len}, "
        f"output {ns.min_output_len}-{ns.max_output_len}, seed {ns.dataset_seed}; "
        f"pagedllm max_num_seqs {eargs.max_num_seqs}, max_num_batched_tokens {eargs.max_num_batched_tokens}"
    )

    print("running pagedllm ...", file=sys.stderr, flush=True)
    rows = [run_pagedllm(llm, requests)]
    # Free the engine (weights and KV cache) so transformers does not run under its memory.
    del llm
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    notes = []
    if not ns.skip_hf:
        hf_reqs = requests[: ns.hf_num_prompts] if ns.hf_num_prompts else requests
        if len(hf_reqs) < len(requests):
            notes.append(
                f"transformers ran only the first {len(hf_reqs)} of {len(requests)} requests; "
                "its rates are extrapolated from that subset"
            )
        print(f"running transformers (static batches of {hf_bs}) ...", file=sys.stderr, flush=True)
        rows.append(run_transformers(model_dir, dtype, tokenizer, hf_reqs, hf_bs, device))

    print()
    print_table(
        rows,
        [
            ("system", "system", ""),
            ("requests", "requests", "d"),
            ("input_tokens", "input tokens", "d"),
            ("output_tokens", "output tokens", "d"),
            ("elapsed_s", "elapsed s", ".2f"),
            ("output_tok_s", "output tok/s", ".1f"),
            ("total_tok_s", "total tok/s", ".1f"),
        ],
    )
    # Other work on the machine skews one phase against the other; a process that got fewer
    # cores than it has threads was sharing the CPU, so its figure is a lower bound.
    print(
        "cores used on average (process CPU time / wall time): "
        + ", ".join(f"{r['system']} {r['cores_used']:.2f}" for r in rows)
        + f" of {machine['torch_threads']} threads"
    )
    ratio = None
    if len(rows) == 2:
        hf = rows[1]
        print(
            f"transformers: {hf['batch_size']} per static batch, {hf['num_batches']} batch(es), "
            f"generated {hf['generated_tokens']} tokens of which {hf['output_tokens']} useful "
            f"({100 * hf['output_tokens'] / hf['generated_tokens']:.1f}%), "
            f"attention {hf['attn_implementation']}"
        )
        ratio = rows[0]["output_tok_s"] / hf["output_tok_s"]
        print(f"ratio (pagedllm / transformers): {ratio:.2f}×")
    for n in notes:
        print(f"note: {n}")

    if ns.output_json:
        settings = {k: v for k, v in vars(ns).items() if k != "func"}
        write_json(
            ns.output_json,
            {
                "command": command_line(),
                "machine": machine,
                "model": model_dir,
                "dtype": str(dtype).removeprefix("torch."),
                "settings": settings,
                "hf_batch_size": hf_bs,
                "results": rows,
                "ratio": ratio,
                "notes": notes,
            },
        )
        print(f"saved {ns.output_json}")
    return 0
