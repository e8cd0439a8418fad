"""`--plot FILE` of `pagedllm bench latency` (the tiny random model) and `bench serve` (against the
shared tiny server): the real commands write a PNG of the percentiles and throughput against the
load, and the JSON rows they draw hold ordered percentiles."""

import json
import subprocess
import sys


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )


def check_png(path, rows, x_key):
    import matplotlib.image

    img = matplotlib.image.imread(str(path))
    assert img.ndim == 3 and img.shape[1] > img.shape[0] > 200 and img.std() > 0.01  # drawn, not blank
    assert len(rows) == 2 and rows[0][x_key] < rows[1][x_key]
    for r in rows:
        for m in ("ttft", "tpot"):
            assert 0 < r[f"p50_{m}_ms"] <= r[f"p90_{m}_ms"] <= r[f"p99_{m}_ms"], r


def test_bench_latency_plot(tmp_path):
    png, out = tmp_path / "lat.png", tmp_path / "lat.json"
    run_cli(
        "bench",
        "latency",
        "--model",
        "random:tiny",
        "--batch-size",
        "1",
        "4",
        "--input-len",
        "8",
        "--output-len",
        "6",
        "--plot",
        str(png),
        "--output-json",
        str(out),
    )
    check_png(png, json.loads(out.read_text())["results"], "batch")


def test_bench_serve_plot(tiny_shared_server, tmp_path):
    png, out = tmp_path / "serve.png", tmp_path / "serve.json"
    run_cli(
        "bench",
        "serve",
        "--base-url",
        tiny_shared_server.url,
        "--tokenizer",
        "random:tiny",
        "--concurrency",
        "1",
        "4",
        "--num-prompts",
        "4",
        "--random-input-len",
        "8",
        "--random-output-len",
        "6",
        "--warmup",
        "0",
        "--plot",
        str(png),
        "--output-json",
        str(out),
    )
    check_png(png, json.loads(out.read_text())["runs"], "concurrency")
