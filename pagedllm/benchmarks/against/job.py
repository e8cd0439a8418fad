"""The job both engines run: one JSON file (model, dtype, scheduler budget, the requests) read by
a runner process on each side, so the two get the very same prompt token ids and output lengths.
Stdlib only: the vLLM side imports it from its own venv, where pagedllm is not installed."""

from __future__ import annotations

import json
import os
import sys
import time

# Before the timed run, on prompts no request starts with (a repeated last token), so that first-
# call allocations and kernel selection are out of the figure and no cache gives a head start.
WARMUP_REQUESTS = 2
WARMUP_PROMPT_LEN = 16
WARMUP_OUTPUT_LEN = 4


def write_job(
    path: str,
    *,
    model: str,
    dtype: str,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int | None,
    seed: int,
    requests,
    first_token_run: bool = False,
) -> dict:
    """requests: objects with .prompt_token_ids (list[int]) and .output_len (int). first_token_run:
    also time the same prompts with one output token each (time_first_token), for the TPOT."""
    job = {
        "first_token_run": first_token_run,
        "model": model,
        "dtype": dtype,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "max_model_len": max_model_len,
        "seed": seed,
        "requests": [
            {"prompt_token_ids": [int(t) for t in r.prompt_token_ids], "output_len": int(r.output_len)}
            for r in requests
        ],
    }
    with open(path, "w") as f:
        json.dump(job, f)
    return job


def read_job(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def prompts_and_lengths(job: dict) -> tuple[list[dict], list[int]]:
    """What each runner hands its engine: token-id prompts (no tokenization) and output lengths."""
    return (
        [{"prompt_token_ids": r["prompt_token_ids"]} for r in job["requests"]],
        [r["output_len"] for r in job["requests"]],
    )


def warmup_prompts(job: dict) -> list[dict]:
    return [
        {"prompt_token_ids": [r["prompt_token_ids"][-1]] * WARMUP_PROMPT_LEN} for r in job["requests"][:WARMUP_REQUESTS]
    ]


def run_job(job: dict, generate, sampling_params, before_timed=None) -> tuple[list, float, float, dict]:
    """Warm-up, then all requests in one timed generate call -> (timed()'s result..., extra).
    generate(prompts, params) is the engine's; sampling_params its SamplingParams class (both
    engines' take these keywords); before_timed() runs between the two (a profiler's start).
    extra: with the job's first_token_run, {"first_token_s": the wall time of the same prompts
    with one output token each}, timed after the full run (prefix caching is off on both)."""
    prompts, lengths = prompts_and_lengths(job)
    params = [sampling_params(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    generate(warmup_prompts(job), sampling_params(temperature=0, max_tokens=WARMUP_OUTPUT_LEN, ignore_eos=True))
    if before_timed is not None:
        before_timed()
    outs, elapsed, cpu = timed(generate, prompts, params)
    extra = {}
    if job.get("first_token_run"):
        one = [sampling_params(temperature=0, max_tokens=1, ignore_eos=True) for _ in lengths]
        extra["first_token_s"] = timed(generate, prompts, one)[1]
    return outs, elapsed, cpu, extra


def timed(generate, prompts, params) -> tuple[list, float, float]:
    """-> (outputs, wall seconds, this process's CPU seconds) of one generate call. The line on
    stderr lets a sampling profiler (py-spy) attach to the engine's processes for this part only."""
    print(f"timed run starts: pid {os.getpid()}", file=sys.stderr, flush=True)
    t0, c0 = time.perf_counter(), time.process_time()
    outs = generate(prompts, params)
    return outs, time.perf_counter() - t0, time.process_time() - c0


def result(system: str, version: str, outs, elapsed: float, cpu: float, load_s: float, extra: dict) -> dict:
    """One row, the same keys from both runners; token ids kept to compare the two outputs.
    With first_token_s in extra, tpot_ms: the full run's time past the first token over its
    decode steps (the longest output's tokens after the first)."""
    in_toks = sum(len(o.prompt_token_ids) for o in outs)
    out_ids = [list(o.outputs[0].token_ids) for o in outs]
    out_toks = sum(len(t) for t in out_ids)
    if "first_token_s" in extra:
        steps = max(len(t) for t in out_ids) - 1
        extra = {**extra, "tpot_ms": 1e3 * (elapsed - extra["first_token_s"]) / steps if steps else float("nan")}
    return {
        **extra,
        "system": system,
        "version": version,
        "requests": len(outs),
        "input_tokens": in_toks,
        "output_tokens": out_toks,
        "elapsed_s": elapsed,
        "output_tok_s": out_toks / elapsed,
        "total_tok_s": (in_toks + out_toks) / elapsed,
        "process_cpu_s": cpu,
        "load_s": load_s,
        "output_token_ids": out_ids,
    }


def write_result(path: str, row: dict) -> None:
    with open(path, "w") as f:
        json.dump(row, f)
