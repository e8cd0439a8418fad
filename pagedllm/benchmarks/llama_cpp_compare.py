"""`bench latency --model FILE.gguf --llama-cpp FILE.gguf`: llama.cpp's own tools on the same
GGUF file and thread count as pagedllm's engine, side by side.

llama.cpp: `llama-bench` (prefill ppP for each --llama-cpp-prefill P, batch-1 decode tgN with N
= --output-len; its warm-up run, then the mean of --llama-cpp-repetitions) and
`llama-batched-bench` (B sequences of a P-token prompt each, then N decode steps of all B: the
decode rate at batch B). pagedllm: the engine's own batch-1 run (prompt P, N new tokens), a
batch-1 prefill of each P (TTFT, LM head and sampling included) and a batch-B run. Per thread
count the two take turns (llama.cpp, then pagedllm) --repeat times, so a shared machine's load
falls on both: each figure is the median of its runs, each ratio the median of the turns'
ratios (a machine whose memory rate moves by a third between minutes moves a single turn's
batch-1 figures as much).
Weights held: pagedllm's resident weight bytes; llama.cpp's tensor bytes (its `model_size`).
"""

from __future__ import annotations

import json
import os
import statistics
import time
import subprocess
import sys

from pagedllm.benchmarks.common import print_table

# (key, what): the compared figures, in the printed order (prefill keys are added per length)
DECODE_1, DECODE_B, WEIGHTS, READ_GBS = "decode_1", "decode_b", "weight_mb", "read_gbs"


def llama_bench_command(tool, path, threads: int, prefills, n_gen: int, repetitions: int) -> list[str]:
    return [
        str(tool),
        "-m",
        str(path),
        "-t",
        str(threads),
        "-p",
        ",".join(str(p) for p in prefills),
        "-n",
        str(n_gen),
        "-r",
        str(repetitions),
        "-o",
        "json",
    ]


def batched_bench_command(tool, path, threads: int, prompt_len: int, n_gen: int, batch: int) -> list[str]:
    """Each of `batch` sequences its own prompt (no -pps), the KV cache sized to hold them all."""
    return [
        str(tool),
        "-m",
        str(path),
        "-t",
        str(threads),
        "-npp",
        str(prompt_len),
        "-ntg",
        str(n_gen),
        "-npl",
        str(batch),
        "-c",
        str(batch * (prompt_len + n_gen)),
        "--output-format",
        "jsonl",
    ]


def parse_llama_bench(stdout: str) -> dict:
    """llama-bench's `-o json` -> {"prefill": {P: tok/s}, "decode": tok/s, "decode_n": N,
    "model_bytes", "threads"} (tok/s: its avg_ts, the mean over the repetitions)."""
    try:
        tests = json.loads(stdout)
    except json.JSONDecodeError as e:
        raise ValueError(f"llama-bench's output is not its JSON: {e}; it began {stdout[:200]!r}") from None
    out = {"prefill": {}}
    for t in tests:
        if t["n_gen"] == 0:
            out["prefill"][int(t["n_prompt"])] = float(t["avg_ts"])
        elif t["n_prompt"] == 0:
            out["decode"], out["decode_n"] = float(t["avg_ts"]), int(t["n_gen"])
        out["model_bytes"], out["threads"] = int(t["model_size"]), int(t["n_threads"])
    if "decode" not in out or not out["prefill"]:
        raise ValueError(f"llama-bench's output lacks a prefill (pp) or a decode (tg) test: {stdout[:300]!r}")
    return out


def parse_batched_bench(stdout: str, batch: int) -> dict:
    """llama-batched-bench's `--output-format jsonl` -> {"decode": tok/s of all `batch` sequences'
    decode steps (speed_tg), "prefill": tok/s of their prompts (speed_pp)}."""
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            row = json.loads(line)
            if row.get("pl") == batch:
                return {"decode": float(row["speed_tg"]), "prefill": float(row["speed_pp"])}
    raise ValueError(f"llama-batched-bench printed no result for {batch} sequences: {stdout[:300]!r}")


def run_batched_bench(cmd: list[str], batch: int, tries: int = 8) -> dict:
    """llama-batched-bench prints its table through llama.cpp's logger, a leaked singleton whose
    writer thread can lose the lines still queued at exit (exit 0, nothing on stdout: ~1 run in 6
    on a busy machine, and three in a row seen under a parallel test run); such a run is run
    again, up to `tries` times."""
    stdout = run_tool(cmd)
    for _ in range(tries - 1):
        if stdout.strip():
            break
        stdout = run_tool(cmd)
    return parse_batched_bench(stdout, batch)


def run_tool(cmd: list[str], with_stderr: bool = False) -> str:
    """Run a llama.cpp tool -> its stdout (and its log, stderr, after it); RuntimeError with the
    log's end when it fails."""
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return proc.stdout + proc.stderr if with_stderr else proc.stdout


def llama_cpp_figures(path, threads: int, prefills, n_gen: int, batch: int, repetitions: int) -> dict:
    from pagedllm.benchmarks.llama_cpp_tools import find_tool

    bench = parse_llama_bench(
        run_tool(llama_bench_command(find_tool("llama-bench"), path, threads, prefills, n_gen, repetitions))
    )
    batched = run_batched_bench(
        batched_bench_command(find_tool("llama-batched-bench"), path, threads, prefills[0], n_gen, batch), batch
    )
    return {
        DECODE_1: bench["decode"],
        **{f"prefill_{p}": v for p, v in bench["prefill"].items()},
        DECODE_B: batched["decode"],
        WEIGHTS: bench["model_bytes"] / 1e6,
    }


def pagedllm_figures(llm, tok, run_pagedllm, prefills, n_gen: int, batch: int, seed: int) -> dict:
    """The engine's batch-1 decode (prompt prefills[0]), each prefill's TTFT as tok/s, batch-B decode;
    run_pagedllm: latency.py's one batch through the engine (given, so this module needs no import of it)."""
    from pagedllm.benchmarks.common import random_requests

    def prompts(n: int, length: int) -> list[list[int]]:
        # a seed per (n, length): no prompt is another's prefix, so none is served from the prefix cache
        return [
            r.prompt_token_ids
            for r in random_requests(tok, n, (length, length), (n_gen, n_gen), seed + 7919 * n + length)
        ]

    one = run_pagedllm(llm, prompts(1, prefills[0]), n_gen, False)
    out = {DECODE_1: one["decode_tok_s"], f"prefill_{prefills[0]}": prefills[0] / one["ttft_s"]}
    for p in prefills[1:]:
        out[f"prefill_{p}"] = p / run_pagedllm(llm, prompts(1, p), 1, False)["ttft_s"]
    out[DECODE_B] = run_pagedllm(llm, prompts(batch, prefills[0]), n_gen, False)["decode_tok_s"]
    out[WEIGHTS] = one["weight_mb"]
    return out


def read_rate_gbs(threads: int, gib: float = 1.0) -> float:
    """The machine's streaming read rate with `threads` threads: the best of 3 torch.sum over a
    float32 buffer far larger than the caches (GB/s). A batch-1 decode reads every weight once
    a token, so the file's bytes at this rate bound its tok/s from above for both engines."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(int(gib * (1 << 30)) // 4)  # [n] float32
        x.sum()
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t0)
        return x.numel() * 4 / best / 1e9
    finally:
        torch.set_num_threads(before)


def compare(
    llm,
    tok,
    run_pagedllm,
    path,
    threads_list,
    prefills,
    n_gen: int,
    batch: int,
    repetitions: int,
    seed: int,
    repeat: int = 1,
) -> list[dict]:
    """Per thread count: `repeat` turns of llama.cpp's figures, then pagedllm's -> one row per
    (threads, figure): the medians, the median of the turns' ratios, those ratios (`pairs`) and
    each engine's figure a turn (`runs`)."""
    import torch

    if not os.path.isfile(path):
        raise ValueError(f"--llama-cpp file {path!r} is not a file")
    rows, turn = [], 0
    for threads in threads_list:
        runs = []  # (llama.cpp's figures, pagedllm's) a turn
        for i in range(repeat):
            at = f" ({i + 1}/{repeat})" if repeat > 1 else ""
            print(f"running llama.cpp on {path} with {threads} threads{at} ...", file=sys.stderr, flush=True)
            theirs = llama_cpp_figures(path, threads, prefills, n_gen, batch, repetitions)
            torch.set_num_threads(threads)
            print(f"running pagedllm with {threads} threads{at} ...", file=sys.stderr, flush=True)
            ours = pagedllm_figures(llm, tok, run_pagedllm, prefills, n_gen, batch, seed + 1_000_003 * turn)
            turn += 1  # new prompts a turn
            # Batch-1 decode as a weight-read rate (each engine's resident weights a token), to set
            # beside the machine's: how far each is from the bandwidth bound.
            for f in (theirs, ours):
                f[READ_GBS] = f[DECODE_1] * f[WEIGHTS] / 1e3
            runs.append((theirs, ours))
        names = figure_names(prefills, n_gen, batch)
        names.append((READ_GBS, f"batch-1 weights read GB/s (machine: {read_rate_gbs(threads):.1f})"))
        for key, what in names:
            each = {"llama.cpp": [theirs[key] for theirs, _ in runs], "pagedllm": [ours[key] for _, ours in runs]}
            pairs = [o / t for t, o in zip(each["llama.cpp"], each["pagedllm"])]
            rows.append(
                {
                    "threads": threads,
                    "figure": what,
                    **{engine: statistics.median(v) for engine, v in each.items()},
                    "ratio": statistics.median(pairs),
                    "pairs": pairs,
                    "runs": each,
                }
            )
    return rows


def figure_names(prefills, n_gen: int, batch: int) -> list[tuple[str, str]]:
    return [
        (DECODE_1, f"batch-1 decode tok/s (tg{n_gen})"),
        *((f"prefill_{p}", f"prefill {p} tok/s (pp{p})") for p in prefills),
        (DECODE_B, f"batch-{batch} decode tok/s"),
        (WEIGHTS, "weights held MB"),
    ]


def print_comparison(rows: list[dict], path) -> None:
    print(f"\nsame file on both sides: {path} ({os.path.getsize(path) / 1e6:.0f} MB)")
    columns = [
        ("threads", "threads", "d"),
        ("figure", "figure", ""),
        ("llama.cpp", "llama.cpp", ".1f"),
        ("pagedllm", "pagedllm", ".1f"),
        ("ratio", "pagedllm / llama.cpp", ".2f"),
    ]
    if any(len(r["pairs"]) > 1 for r in rows):  # the medians' turns
        rows = [{**r, "turns": " / ".join(f"{x:.2f}" for x in r["pairs"])} for r in rows]
        columns.append(("turns", "each turn's ratio", ""))
    print_table(rows, columns)
