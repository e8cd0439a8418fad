"""Runs a job (job.py) through pagedllm's LLM.generate in a process of its own, as vLLM's runs.

`python -m pagedllm.benchmarks.against.pagedllm_offline JOB.json RESULT.json ENGINE_ARGS.json
[--profile]`: the engine flags of the bench command, with the job's model, dtype and budget over
them; --profile adds the per-phase step profile of the timed run to the result.
"""

from __future__ import annotations

import argparse
import json
import time

from pagedllm.benchmarks.against import job as J


def main(job_path: str, result_path: str, engine_args_path: str, profile: bool = False) -> None:
    import pagedllm
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.profiler import PROFILER, summarize
    from pagedllm.sampling_params import SamplingParams

    job = J.read_job(job_path)
    with open(engine_args_path) as f:
        kwargs = json.load(f)
    kwargs.update(
        model=job["model"],
        dtype=job["dtype"],
        seed=job["seed"],
        enable_prefix_caching=False,
        max_num_seqs=job["max_num_seqs"],
        max_num_batched_tokens=job["max_num_batched_tokens"],
        max_model_len=job["max_model_len"],
    )
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t0
    outs, elapsed, cpu, extra = J.run_job(
        job, lambda p, sp: llm.generate(p, sp, use_tqdm=False), SamplingParams, PROFILER.start if profile else None
    )
    row = J.result("pagedllm", getattr(pagedllm, "__version__", "dev"), outs, elapsed, cpu, load_s, extra)
    if profile:
        steps = PROFILER.stop()
        row["profile"] = {
            "all": summarize(steps),
            "decode": summarize([s for s in steps if s["num_tokens"] == s["num_reqs"]]),
            "with_prefill": summarize([s for s in steps if s["num_tokens"] != s["num_reqs"]]),
        }
    J.write_result(result_path, row)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    for name in ("job", "result", "engine_args"):
        ap.add_argument(name)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    main(a.job, a.result, a.engine_args, a.profile)
