"""A/B of two builds of the C++ kernels on one engine's decode steps: the decode loop's extension
is swapped step by step (in ABBA order) and each step's `decode_layers` call timed, so both builds
meet the same contexts, memory state and machine load. On a shared machine whole benchmark runs a
minute apart move by more than a lever of a few percent; adjacent steps do not. The other build
is the csrc directory of another tree (e.g. `git archive REV | tar -x -C /tmp/old`), built for
the same ISA as this one's.

    PYTHONPATH=. python tools/ab_decode_loop.py llama1b.Q4_0.gguf --against-tree /tmp/old --batch-size 1
    PYTHONPATH=. python tools/ab_decode_loop.py DIR --dtype bfloat16 --against-tree /tmp/old --batch-size 16

Prints each build's median step and the median over adjacent pairs of other / this.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--against-tree", required=True, help="a tree whose pagedllm/csrc is the other build")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=256, help="decode steps (tokens a request)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="the engine's dtype (e.g. bfloat16 for an HF directory)")
    ap.add_argument("--warmup", type=int, default=4, help="steps of each build left out")
    args = ap.parse_args()

    import torch

    from pagedllm import LLM, SamplingParams
    from pagedllm.csrc import build

    torch.set_num_threads(args.threads)
    src = Path(args.against_tree) / "pagedllm" / "csrc"
    sources = sorted(p.name for p in src.glob("*.cpp"))
    isa = build.selected_isa()
    other = build.build_extension(f"pagedllm_cpu_{isa}", src, sources, build.isa_cflags(isa))
    if other is None:
        raise SystemExit(f"the other tree's kernels did not build: {build.build_failures}")
    llm = LLM(
        args.model,
        dtype=args.dtype,
        enable_prefix_caching=False,
        max_model_len=args.input_len + args.steps + 16,
    )
    loop = llm.llm_engine.core.model_executor.driver_worker.model_runner.decode_loop
    if loop is None:
        raise SystemExit("the engine built no C++ decode loop for this model")
    exts = {"this": loop.ext, "other": other}
    times: dict[str, list[float]] = {"this": [], "other": []}
    calls = [0]
    call = type(loop).__call__

    def timed(self, *a, **kw):
        n = calls[0]
        calls[0] += 1
        key = ("this", "other", "other", "this")[n % 4]  # ABBA: neither build always goes first
        self.ext = exts[key]
        t = time.perf_counter()
        out = call(self, *a, **kw)
        times[key].append(time.perf_counter() - t)
        return out

    type(loop).__call__ = timed
    prompts = [
        {"prompt_token_ids": [(17 * i + j) % 1000 + 10 for j in range(args.input_len)]} for i in range(args.batch_size)
    ]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True), use_tqdm=False)
    this, other_t = times["this"][args.warmup :], times["other"][args.warmup :]
    for key, v in (("this", this), ("other", other_t)):
        print(f"{key:5s} build: {len(v)} steps, median {1e3 * statistics.median(v):.2f} ms")
    ratios = [o / t for o, t in zip(other_t, this)]
    print(f"other / this, adjacent pairs: median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
