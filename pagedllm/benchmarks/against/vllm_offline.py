"""Runs a job (job.py) through vLLM's offline LLM.generate; run by the vLLM venv's python.

`python vllm_offline.py JOB.json RESULT.json`. The `__main__` guard is required: vLLM spawns its
engine core as a separate process that re-imports this file.
"""

from __future__ import annotations

import os
import sys
import time


def main(job_path: str, result_path: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import job as J  # this directory's job.py: pagedllm itself is not installed in the vLLM venv
    import vllm
    from vllm import LLM, SamplingParams

    job = J.read_job(job_path)
    t0 = time.perf_counter()
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        seed=job["seed"],
        enable_prefix_caching=False,
        max_num_seqs=job["max_num_seqs"],
        max_num_batched_tokens=job["max_num_batched_tokens"],
        max_model_len=job["max_model_len"],
    )
    load_s = time.perf_counter() - t0
    outs, elapsed, cpu, extra = J.run_job(job, lambda p, sp: llm.generate(p, sp, use_tqdm=False), SamplingParams)
    J.write_result(result_path, J.result("vllm", vllm.__version__, outs, elapsed, cpu, load_s, extra))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
