"""`pagedllm bench vision --throughput N`: offline throughput with images in the batch. N
requests with random text (--input-len tokens, spread by --random-range-ratio as vLLM's random
dataset), a fixed output length (ignore_eos); a fraction of them (--image-fraction) carry an
image before their text. Three runs of the same texts on one engine (prefix caching on, emptied
before each run), each timed as a whole (LLM.generate over the list, the HF processor included):
  text only        the images removed: the baseline;
  distinct images  every image-carrying request its own image: one encoder run each;
  same image       all of them one image: encoded once per step that needs it, unless the
                   encoder cache still holds it or the prefix cache covers it (the counters say).
Per run: requests/s, output and total tokens/s, images encoded, the encoder cache's queries and
hits, prompt tokens served by the prefix cache, and the share of the run's time spent inside
the encoder and inside the HF processor. Rounds (--repeat) use fresh texts and images (nothing
cached from an earlier round); timings are medians, counters per round."""

from __future__ import annotations

import statistics
import time

import numpy as np

RUNS = ("text only", "distinct images", "same image")
COUNTERS = ("images_encoded", "mm_queries", "mm_hits", "cached_tokens")


def add_cli_args(p) -> None:
    p.add_argument(
        "--throughput",
        type=int,
        default=0,
        metavar="N",
        help="instead of the chat TTFT table: offline throughput of N requests, a fraction of them with "
        "an image, beside the same texts without images and with one image shared by all",
    )
    p.add_argument(
        "--image-fraction", type=float, default=0.5, help="--throughput: the share of requests with an image"
    )
    p.add_argument("--input-len", type=int, default=64, help="--throughput: random text tokens per request (mean)")
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.5,
        help="--throughput: text lengths uniform in input-len * [1 - ratio, 1 + ratio]",
    )
    p.add_argument("--seed", type=int, default=0, help="--throughput: seed of the texts, lengths and images")


def check_args(ns) -> None:
    if ns.throughput < 1:
        raise ValueError(f"throughput must be >= 1 requests, got {ns.throughput}")
    if not 0.0 <= ns.image_fraction <= 1.0:
        raise ValueError(f"image_fraction must be in [0, 1], got {ns.image_fraction}")
    if ns.input_len < 1:
        raise ValueError(f"input_len must be >= 1, got {ns.input_len}")
    if not 0.0 <= ns.random_range_ratio < 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {ns.random_range_ratio}")


def random_texts(tokenizer, n: int, input_len: int, ratio: float, rng, avoid: str) -> list[str]:
    """n texts decoded from ordinary token ids (no special or added tokens), lengths uniform in
    input_len * [1 - ratio, 1 + ratio]; none contains `avoid` (the image placeholder)."""
    lo, hi = max(1, round(input_len * (1 - ratio))), round(input_len * (1 + ratio))
    excluded = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    vocab = np.setdiff1d(np.arange(tokenizer.vocab_size), np.fromiter(excluded, dtype=np.int64))
    texts = []
    while len(texts) < n:
        text = tokenizer.decode(rng.choice(vocab, size=int(rng.integers(lo, hi + 1))).tolist())
        if text.strip() and avoid not in text:
            texts.append(text)
    return texts


class _Clocks:
    """Wall seconds spent inside methods wrapped with time(), by name (an instance attribute
    shadows the class's method: the engine's own calls go through the wrapper)."""

    def __init__(self) -> None:
        self.s: dict[str, float] = {}

    def time(self, obj, method: str, name: str, sync=lambda: None) -> None:
        inner = getattr(obj, method)
        self.s[name] = 0.0

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                sync()  # a GPU's encoder work is asynchronous: count it where it is launched
                self.s[name] += time.perf_counter() - start

        setattr(obj, method, timed)


def _run(llm, prompts, params, clocks: _Clocks) -> dict:
    """One timed LLM.generate over the prompts, the prefix cache emptied first (the runs share
    their texts) -> its row (timings and counter deltas)."""
    core = llm.llm_engine.core
    cache = core.model_executor.driver_worker.model_runner.encoder_cache
    sched = core.scheduler
    if not llm.reset_prefix_cache():
        raise RuntimeError("the engine has unfinished requests: the prefix cache cannot be emptied")
    before = (cache.images_encoded, sched.mm_cache_queries, sched.mm_cache_hits, dict(clocks.s))
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    prompt_toks = sum(len(o.prompt_token_ids) for o in outs)
    out_toks = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "requests": len(outs),
        "images": sum(isinstance(p, dict) for p in prompts),
        "prompt_tokens": prompt_toks,
        "output_tokens": out_toks,
        "elapsed_s": elapsed,
        "req_s": len(outs) / elapsed,
        "output_tok_s": out_toks / elapsed,
        "total_tok_s": (prompt_toks + out_toks) / elapsed,
        "encoder_share": (clocks.s["encoder"] - before[3]["encoder"]) / elapsed,
        "processor_share": (clocks.s["processor"] - before[3]["processor"]) / elapsed,
        "images_encoded": cache.images_encoded - before[0],
        "mm_queries": sched.mm_cache_queries - before[1],
        "mm_hits": sched.mm_cache_hits - before[2],
        "cached_tokens": sum(o.num_cached_tokens for o in outs),
    }


def _prompts(texts, with_image, placeholder, images) -> list:
    """Text-only prompts, or {"prompt", "multi_modal_data"} with the image before the text."""
    it = iter(images)
    return [
        {"prompt": placeholder + t, "multi_modal_data": {"image": next(it)}} if w else t
        for t, w in zip(texts, with_image)
    ]


def run_throughput(llm, ns, make_image) -> dict:
    """The rounds; make_image(seed, side) -> a PIL image. Returns the results (medians, rounds)."""
    import torch

    from pagedllm.multimodal.chat import chat_placeholder
    from pagedllm.sampling_params import SamplingParams

    check_args(ns)
    processor = llm.llm_engine.processor
    placeholder = chat_placeholder(processor.load_mm_processor())
    runner = llm.llm_engine.core.model_executor.driver_worker.model_runner
    on_gpu = next(runner.model.parameters()).device.type == "cuda"
    clocks = _Clocks()
    clocks.time(runner.encoder_cache, "_encode", "encoder", torch.cuda.synchronize if on_gpu else (lambda: None))
    clocks.time(processor, "process_images", "processor")
    params = SamplingParams(temperature=0, max_tokens=ns.output_len, ignore_eos=True)
    n_img = round(ns.throughput * ns.image_fraction)
    # Warm-up: the text and image paths once, on an image and texts no round uses.
    warm = random_texts(llm.get_tokenizer(), 2, 8, 0.0, np.random.default_rng(2**31), placeholder)
    llm.generate(_prompts(warm, [True, False], placeholder, [make_image(99, ns.image_size)]), params, use_tqdm=False)
    rounds = []
    for r in range(ns.repeat):
        rng = np.random.default_rng([ns.seed, r])
        texts = random_texts(llm.get_tokenizer(), ns.throughput, ns.input_len, ns.random_range_ratio, rng, placeholder)
        with_image = np.zeros(ns.throughput, dtype=bool)
        with_image[rng.permutation(ns.throughput)[:n_img]] = True
        base = 100_000 + 1000 * (ns.seed * 97 + r)  # image seeds of this round, none shared with another
        distinct = [make_image(base + i, ns.image_size) for i in range(n_img)]
        same = [make_image(base + 999, ns.image_size)] * n_img
        rows = {
            RUNS[0]: _run(llm, texts, params, clocks),
            RUNS[1]: _run(llm, _prompts(texts, with_image, placeholder, distinct), params, clocks),
            RUNS[2]: _run(llm, _prompts(texts, with_image, placeholder, same), params, clocks),
        }
        rounds.append(rows)
    table = []
    for name in RUNS:
        per_round = [rnd[name] for rnd in rounds]
        row = {"run": name, **{k: per_round[0][k] for k in ("requests", "images", "prompt_tokens", "output_tokens")}}
        row.update(
            {
                k: statistics.median(x[k] for x in per_round)
                for k in ("elapsed_s", "req_s", "output_tok_s", "total_tok_s", "encoder_share", "processor_share")
            }
        )
        row.update({k: [x[k] for x in per_round] for k in COUNTERS})
        table.append(row)
    return {
        "rows": table,
        "image_requests": n_img,
        "ratio_req_s": table[1]["req_s"] / table[0]["req_s"],
        "same_vs_distinct_req_s": table[2]["req_s"] / table[1]["req_s"],
    }


def print_throughput(res: dict, ns) -> None:
    from pagedllm.benchmarks.common import print_table

    print(
        f"{ns.throughput} requests, {res['image_requests']} with a {ns.image_size}x{ns.image_size} image "
        f"(before the text); text {ns.input_len} tokens +-{ns.random_range_ratio:.0%}, output {ns.output_len} "
        f"(ignore_eos); {ns.repeat} rounds, median timings, counters per round\n"
    )
    cells = [
        {
            **r,
            **{k: "/".join(map(str, r[k])) for k in COUNTERS},
            "enc_pct": 100 * r["encoder_share"],
            "proc_pct": 100 * r["processor_share"],
        }
        for r in res["rows"]
    ]
    print_table(
        cells,
        [
            ("run", "run", ""),
            ("images", "images", "d"),
            ("prompt_tokens", "prompt tok", "d"),
            ("req_s", "req/s", ".2f"),
            ("output_tok_s", "out tok/s", ".1f"),
            ("total_tok_s", "total tok/s", ".1f"),
            ("images_encoded", "encoded", ""),
            ("mm_queries", "enc-cache queries", ""),
            ("mm_hits", "hits", ""),
            ("cached_tokens", "prefix-cached tok", ""),
            ("enc_pct", "encoder %", ".1f"),
            ("proc_pct", "processor %", ".1f"),
        ],
    )
    print(
        f"\nreq/s with images / text only: {res['ratio_req_s']:.2f}x; same image / distinct images: "
        f"{res['same_vs_distinct_req_s']:.2f}x"
    )
