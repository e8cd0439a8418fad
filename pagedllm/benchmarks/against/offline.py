"""`pagedllm bench throughput --against vllm`: the throughput workload through pagedllm and through
vLLM's CPU build, each in a process of its own, interleaved (A B A B ...), medians side by side.

Both read one job file (job.py): the same prompt token ids and output lengths, greedy,
ignore_eos, prefix caching off, the same dtype, max_num_seqs and max_num_batched_tokens. Each
engine is timed over one generate call of all requests after the same warm-up; model loading and
compilation are outside the figure (and printed apart).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pagedllm.benchmarks.against import job as J
from pagedllm.benchmarks.against import venv as V
from pagedllm.benchmarks.common import (
    command_line,
    machine_info,
    print_profile,
    print_table,
    workload_requests,
    write_json,
)

DTYPES = ("bfloat16", "float32")  # what vLLM's CPU backend runs


def check_args(ns: argparse.Namespace) -> None:
    """Only what both engines can run alike; a ValueError naming the flag otherwise."""
    if ns.against != "vllm":
        raise ValueError(f"against must be 'vllm', got {ns.against!r}")
    if ns.repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {ns.repeat}")
    if ns.dtype not in DTYPES + ("auto",):
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (or auto) with --against vllm, got {ns.dtype!r}")
    if ns.device not in ("auto", "cpu"):
        raise ValueError(f"device must be cpu with --against vllm (vLLM's CPU build), got {ns.device!r}")
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        if getattr(ns, name, 1) != 1:
            raise ValueError(f"{name} must be 1 with --against vllm, got {getattr(ns, name)}")
    for name in ("quantization", "speculative_config", "kv_transfer_config"):
        if getattr(ns, name, None):
            raise ValueError(f"{name} is not compared with --against vllm: leave it unset")
    if getattr(ns, "kv_cache_dtype", "auto") != "auto":
        raise ValueError(f"kv_cache_dtype must be auto with --against vllm, got {ns.kv_cache_dtype!r}")
    if getattr(ns, "enable_lora", False):
        raise ValueError("enable_lora is not compared with --against vllm: leave it unset")


def _run(cmd: list, env: dict | None, result_path: Path, label: str, py_spy: Path | None = None) -> dict:
    """One runner process (its logs to stderr: stdout is the table). With py_spy, a py-spy record
    (raw collapsed stacks, the runner and its child processes) of the timed run goes to that file."""
    print(f"running {label} ...", file=sys.stderr, flush=True)
    proc = subprocess.Popen([str(c) for c in cmd], env=env, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    spy = None
    for line in proc.stderr:
        sys.stderr.write(line)
        if py_spy is not None and spy is None and line.startswith("timed run starts"):
            spy = subprocess.Popen(
                [
                    _py_spy(),
                    "record",
                    "--pid",
                    str(proc.pid),
                    "--subprocesses",
                    "--nonblocking",
                    "--format",
                    "raw",
                    "--output",
                    str(py_spy),
                ],
                stdout=sys.stderr,
                stderr=sys.stderr,
            )
    rc = proc.wait()
    if spy is not None:
        spy.wait()
    if rc != 0:
        raise RuntimeError(f"{label} failed (exit {rc}): {' '.join(map(str, cmd))}")
    with open(result_path) as f:
        row = json.load(f)
    print(f"{label}: {row['elapsed_s']:.2f} s, {row['output_tok_s']:.1f} output tok/s", file=sys.stderr, flush=True)
    return row


def _py_spy() -> str:
    found = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if not found:
        raise ValueError("py_spy needs the py-spy command (pip install py-spy)")
    return found


def summarize(runs: list[dict]) -> dict:
    """Median and spread (min, max) of one system's runs."""
    rates = [r["output_tok_s"] for r in runs]
    times = [r["elapsed_s"] for r in runs]
    return {
        **{k: runs[0][k] for k in ("system", "version", "requests", "input_tokens", "output_tokens")},
        "runs": len(runs),
        "elapsed_s": statistics.median(times),
        "output_tok_s": statistics.median(rates),
        "total_tok_s": statistics.median(r["total_tok_s"] for r in runs),
        "min_tok_s": min(rates),
        "max_tok_s": max(rates),
        "spread_pct": 100 * (max(rates) - min(rates)) / statistics.median(rates),
        "load_s": statistics.median(r["load_s"] for r in runs),
    }


def same_outputs(a: dict, b: dict) -> int:
    """Requests whose output token ids are identical in both (bf16 rounding may part them)."""
    return sum(x == y for x, y in zip(a["output_token_ids"], b["output_token_ids"]))


@dataclass
class Setup:
    """What both sides of a comparison share: the engine flags, the model, the vLLM venv, the CPUs."""

    eargs: object
    model_dir: str
    dtype: str
    tokenizer: object
    kv_gib: int
    venv_dir: Path
    vllm_py: Path
    cpus: list[int]
    machine: dict


def prepare(ns: argparse.Namespace) -> Setup:
    """Checks the flags (before any install), resolves the model and dtype, makes the vLLM venv
    (once) and prints the machine lines."""
    from pagedllm.config import resolve_dtype
    from pagedllm.engine.llm_engine import load_tokenizer
    from pagedllm.entrypoints.cli import engine_args_from
    from pagedllm.models.download import resolve_model
    from pagedllm.models.model_config_loader import model_config_from_dir

    check_args(ns)
    eargs = engine_args_from(ns)
    model_dir = str(resolve_model(ns.model, None))
    dtype = ns.dtype
    if dtype == "auto":  # pagedllm's choice on the CPU, given to vLLM too
        dtype = resolve_dtype("auto", model_config_from_dir(model_dir, dtype="auto").hf_config, "cpu")
    venv_dir = Path(ns.vllm_venv).expanduser() if ns.vllm_venv else V.default_venv()
    s = Setup(
        eargs=eargs,
        model_dir=model_dir,
        dtype=dtype,
        tokenizer=load_tokenizer(model_dir),
        kv_gib=V.kv_cache_gib(eargs.kv_cache_memory),
        venv_dir=venv_dir,
        vllm_py=V.ensure_vllm_venv(venv_dir),
        cpus=sorted(os.sched_getaffinity(0)),
        machine=machine_info(),
    )
    print(f"command: {command_line()}")
    print(
        f"machine: {s.machine['cpu']}, {s.machine['cores']} cores; pagedllm torch {s.machine['torch']} with "
        f"{s.machine['torch_threads']} threads, vLLM OpenMP bound to CPUs {V.cpu_list(s.cpus)}"
    )
    print(f"model: {model_dir} ({dtype}, greedy, ignore_eos, prefix caching off on both)")
    return s


def json_header(s: Setup) -> dict:
    """The first keys of a comparison's --output-json: what was run, where."""
    return {
        "command": command_line(),
        "machine": s.machine,
        "model": s.model_dir,
        "dtype": s.dtype,
        "vllm_cpus": V.cpu_list(s.cpus),
    }


def write_job(s: Setup, path: Path, requests, first_token_run: bool = False) -> None:
    """The job file (job.py) of these requests under the setup's model, dtype and budget."""
    J.write_job(
        str(path),
        model=s.model_dir,
        dtype=s.dtype,
        max_num_seqs=s.eargs.max_num_seqs,
        max_num_batched_tokens=s.eargs.max_num_batched_tokens,
        max_model_len=s.eargs.max_model_len,
        seed=s.eargs.seed,
        requests=requests,
        first_token_run=first_token_run,
    )


def run_pair(s: Setup, tmp: Path, job: Path, label: str, profile: bool = False, spy: Path | None = None):
    """pagedllm's runner, then vLLM's, on one job file -> (pagedllm row, vLLM row)."""
    engine_json = tmp / "engine.json"
    if not engine_json.exists():
        kwargs = {k: v for k, v in vars(s.eargs).items() if isinstance(v, (str, int, float, bool, type(None)))}
        engine_json.write_text(json.dumps(kwargs))
    mine = _run(
        [sys.executable, "-m", "pagedllm.benchmarks.against.pagedllm_offline", job, tmp / "p.json", engine_json]
        + (["--profile"] if profile else []),
        None,
        tmp / "p.json",
        f"pagedllm ({label})",
        spy and spy / "pagedllm.txt",
    )
    theirs = _run(
        [s.vllm_py, Path(__file__).parent / "vllm_offline.py", job, tmp / "v.json"],
        V.vllm_env(s.venv_dir, s.cpus, s.kv_gib),
        tmp / "v.json",
        f"vLLM ({label})",
        spy and spy / "vllm.txt",
    )
    return mine, theirs


def main(ns: argparse.Namespace) -> int:
    if ns.py_spy:
        check_args(ns)
        _py_spy()
        os.makedirs(ns.py_spy, exist_ok=True)
    s = prepare(ns)
    requests = workload_requests(s.tokenizer, ns)
    eargs = s.eargs
    print(
        f"requests: {len(requests)}, input {ns.min_input_len}-{ns.max_input_len}, output "
        f"{ns.min_output_len}-{ns.max_output_len}, seed {ns.dataset_seed}; both: max_num_seqs "
        f"{eargs.max_num_seqs}, max_num_batched_tokens {eargs.max_num_batched_tokens}; "
        f"KV cache {s.kv_gib} GiB; {ns.repeat} interleaved run(s) each"
    )

    with tempfile.TemporaryDirectory(prefix="pagedllm-against-") as tmp:
        tmp = Path(tmp)
        write_job(s, tmp / "job.json", requests)
        runs = {"pagedllm": [], "vllm": []}
        for i in range(ns.repeat):
            spy = Path(ns.py_spy) if ns.py_spy and i == 0 else None
            mine, theirs = run_pair(s, tmp, tmp / "job.json", f"{i + 1}/{ns.repeat}", ns.profile and i == 0, spy)
            runs["pagedllm"].append(mine)
            runs["vllm"].append(theirs)

    rows = [summarize(runs["pagedllm"]), summarize(runs["vllm"])]
    print()
    print_table(
        rows,
        [
            ("system", "system", ""),
            ("version", "version", ""),
            ("output_tokens", "output tokens", "d"),
            ("elapsed_s", "median s", ".2f"),
            ("output_tok_s", "median out tok/s", ".1f"),
            ("min_tok_s", "min", ".1f"),
            ("max_tok_s", "max", ".1f"),
            ("spread_pct", "spread %", ".1f"),
            ("load_s", "load s", ".1f"),
        ],
    )
    ratio = rows[0]["output_tok_s"] / rows[1]["output_tok_s"]
    per_run = [p["output_tok_s"] / v["output_tok_s"] for p, v in zip(runs["pagedllm"], runs["vllm"])]
    print(
        f"ratio (pagedllm / vLLM, medians): {ratio:.2f}× (per interleaved pair: "
        + ", ".join(f"{r:.2f}" for r in per_run)
        + ")"
    )
    if ns.profile:
        prof = runs["pagedllm"][0]["profile"]
        print_profile("pagedllm, first run, decode-only steps", prof["decode"])
        print_profile("pagedllm, first run, steps with a prefill", prof["with_prefill"])
        print_profile("pagedllm, first run, all steps", prof["all"])
    print(f"identical greedy outputs: {same_outputs(runs['pagedllm'][0], runs['vllm'][0])} of {len(requests)} requests")
    if ns.output_json:
        for rs in runs.values():
            for r in rs:
                r.pop("output_token_ids", None)
        write_json(
            ns.output_json,
            {
                **json_header(s),
                "summary": rows,
                "runs": runs,
                "ratio": ratio,
                "ratios_per_pair": per_run,
            },
        )
        print(f"saved {ns.output_json}")
    return 0
