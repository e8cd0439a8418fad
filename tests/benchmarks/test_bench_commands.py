"""The `pagedllm bench` subcommands a user runs, end to end as subprocesses on tiny random models
and small workloads: each finishes, writes its JSON, and what it reports holds against values
worked out here (FLOPs from the config by hand, the prefix-cache hits of a shared prompt, two
systems fed the same requests counting the same tokens). Speed figures are BENCHMARKS.md's."""

import json
import subprocess
import sys

import pytest
from server_utils import REPO, TINY

pytestmark = pytest.mark.slow


def bench(tmp_path, *args: str) -> dict:
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", *args, "--output-json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(out.read_text())


def test_throughput(tmp_path):
    d = bench(
        tmp_path,
        "throughput",
        "--model",
        TINY,
        "--num-prompts",
        "6",
        "--max-input-len",
        "40",
        "--min-output-len",
        "4",
        "--max-output-len",
        "12",
        "--hf-num-prompts",
        "6",
    )
    ours, hf = d["results"]
    assert (ours["system"], hf["system"]) == ("pagedllm", "transformers")
    # The same 6 requests: the same prompt and output tokens counted by both.
    assert ours["requests"] == hf["requests"] == 6
    assert ours["input_tokens"] == hf["input_tokens"] and ours["output_tokens"] == hf["output_tokens"]
    assert d["ratio"] == pytest.approx(ours["output_tok_s"] / hf["output_tok_s"])


def test_prefix_caching(tmp_path):
    """4 prompts of one 64-token system prompt (4 blocks of 16) and 8-token questions: with
    caching the last 3 find the 4 blocks (192 tokens), and the outputs are those without it."""
    d = bench(
        tmp_path,
        "prefix-caching",
        "--model",
        TINY,
        "--num-prompts",
        "4",
        "--system-len",
        "64",
        "--question-len",
        "8",
        "--output-len",
        "4",
    )
    off, on = d["rows"]
    assert (off["system"], on["system"]) == ("prefix caching off", "prefix caching on")
    assert (off["cached_tokens"], on["cached_tokens"]) == (0, 3 * 64)
    assert d["outputs_identical"] is True


def test_roofline(tmp_path):
    d = bench(
        tmp_path,
        "roofline",
        "--model",
        TINY,
        "--num-prompts",
        "4",
        "--max-input-len",
        "32",
        "--min-output-len",
        "4",
        "--max-output-len",
        "8",
        "--mm-size",
        "256",
    )
    cfg = json.loads(open(f"{d['model']}/config.json").read())
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    weights = h * q + 2 * h * kv + q * h + 3 * h * i  # q, k, v, o; gate, up, down
    assert d["model_flops"] == {
        "linear": 2 * layers * weights,
        "lm_head": 2 * h * cfg["vocab_size"],
        "attention_per_ctx": 2 * 2 * q * layers,
    }
    run = d["pagedllm"]
    assert d["achieved_flops_per_s"] == pytest.approx(d["workload_flops"] / run["elapsed_s"])
    assert d["fraction"] == pytest.approx(d["achieved_flops_per_s"] / max(d["mm_flops_per_s"]))


def test_kv_memory_without_sliding_layers(tmp_path):
    """random:tiny has no sliding-window layer: both accountings hold the same blocks."""
    d = bench(tmp_path, "kv-memory", "--model", TINY, "--input-len", "8", "--output-len", "40")
    assert d["rows"] and all(r["saving"] == 1.0 and r["groups_mib"] == r["one_table_mib"] for r in d["rows"])
    assert d["peak_bytes_groups"] == d["peak_bytes_one_table"] > 0


def test_lora(tmp_path):
    d = bench(
        tmp_path,
        "lora",
        "--model",
        TINY,
        "--num-prompts",
        "4",
        "--num-adapters",
        "2",
        "--rank",
        "4",
        "--input-len",
        "8",
        "16",
        "--output-len",
        "4",
        "8",
    )
    base, lora = d["rows"]
    assert base["system"] == "base model" and lora["system"] == "2 adapters, rank 4"
    assert base["requests"] == lora["requests"] == 4 and base["output_tokens"] == lora["output_tokens"]
    assert d["ratio"] == pytest.approx(lora["output_tok_s"] / base["output_tok_s"])


def test_perplexity_against_transformers(tmp_path):
    """random:tiny's words ("w<id>") as the text: pagedllm's float32 perplexity equals
    transformers' on the same windows."""
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{(i * 37) % 500 + 3}" for i in range(150)))
    d = bench(
        tmp_path,
        "perplexity",
        "--model",
        TINY,
        "--text",
        str(text),
        "--dtypes",
        "float32",
        "--hf-dtypes",
        "float32",
        "--window",
        "64",
        "--stride",
        "32",
    )
    rows = {r["system"]: r for r in d["results"]}
    assert set(rows) == {"pagedllm", "transformers"} and d["text_tokens"] == 150
    assert rows["pagedllm"]["perplexity"] == pytest.approx(rows["transformers"]["perplexity"], rel=1e-4)


def test_structured(tmp_path):
    sys.path.insert(0, f"{REPO}/tests/structured_output")
    from tiny_chat_model import make_tiny_chat_model

    model = make_tiny_chat_model(tmp_path / "tiny-chat")
    d = bench(tmp_path, "structured", "--model", str(model), "--num-prompts", "4", "--output-len", "64")
    free, constrained = d["rows"]
    assert (free["system"], constrained["system"]) == ("unconstrained", "JSON schema")
    # A random model writes long strings: each answer is whole JSON or cut at --output-len.
    assert free["requests"] == constrained["requests"] == 4
    assert constrained["valid_json"] == 4 or constrained["output_tokens"] > 3 * 64, constrained


def test_encoder(tmp_path):
    d = bench(tmp_path, "encoder", "--num-requests", "12", "--max-num-seqs", "4", "--repeat", "1")
    assert [r["name"] for r in d["rows"]] == ["batched", "one at a time", "sentence-transformers encode"]
    for r in d["rows"]:  # texts/s is the texts over the median round's seconds
        assert r["rate"] == pytest.approx(12 / r["s"]) and r["s"] == d["seconds"][r["name"]][0]
    assert d["max_diff"] < 1e-5  # the served vectors are sentence-transformers' (the work timed is right)


def test_vision(tmp_path):
    """Turn 2 of a chat about an image, on the tiny random Idefics3: the prefix cache serves the
    image's blocks (whole blocks of 16, past the image's 16 placeholder tokens), the encoder does
    not run again (turn 1's 16 answer tokens fill the block where the image ends), and the answer
    is that of an engine that re-encodes it."""
    d = bench(tmp_path, "vision", "--shape", "tiny", "--image-size", "64", "--repeat", "2")
    assert d["image_tokens"] == 16 and d["turn2_encoder_runs"] == [0, 0] and d["turn2_answers_identical"]
    assert all(c % 16 == 0 and c > 16 for c in d["turn2_cached"]), d["turn2_cached"]
    assert set(d["medians"]) == {
        "processor_s",
        "encode_s",
        "turn1_ttft_s",
        "turn2_hit_ttft_s",
        "turn2_reencoded_ttft_s",
    }


def test_vision_throughput(tmp_path):
    """8 requests, 4 with a 64 x 64 image before their text, on the tiny random Idefics3. Each
    image is 23 prompt tokens (<fake_token_around_image>, "<global-img>" as 5 text tokens, 16
    image tokens, <fake_token_around_image>). All eight prompts fit one step's token budget
    (2048): the distinct images are encoded once each; the shared image once, the other three
    requests finding it in the encoder cache and the first's block of 16 (its tags and first 10
    image tokens) in the prefix cache, registered as the step scheduled it."""
    d = bench(
        tmp_path,
        "vision",
        "--shape",
        "tiny",
        "--image-size",
        "64",
        "--throughput",
        "8",
        "--input-len",
        "16",
        "--output-len",
        "4",
        "--repeat",
        "1",
    )
    text, distinct, same = d["rows"]
    assert [r["run"] for r in d["rows"]] == ["text only", "distinct images", "same image"]
    assert all(r["requests"] == 8 and r["output_tokens"] == 8 * 4 for r in d["rows"])
    assert (text["images"], distinct["images"], same["images"]) == (0, 4, 4) and d["image_requests"] == 4
    assert distinct["prompt_tokens"] == same["prompt_tokens"] == text["prompt_tokens"] + 4 * 23
    counters = ("images_encoded", "mm_queries", "mm_hits", "cached_tokens")
    assert [text[k] for k in counters] == [[0], [0], [0], [0]] and text["encoder_share"] == 0
    assert [distinct[k] for k in counters] == [[4], [4], [0], [0]]
    assert [same[k] for k in counters] == [[1], [4], [3], [3 * 16]]
    assert all(0 < r["encoder_share"] < 1 and 0 < r["processor_share"] < 1 for r in (distinct, same))
    assert d["ratio_req_s"] == pytest.approx(distinct["req_s"] / text["req_s"])
    assert text["total_tok_s"] == pytest.approx((text["prompt_tokens"] + 32) / text["elapsed_s"])


def test_vision_qwen2_5_vl(tmp_path):
    """The same on a tiny Qwen2.5-VL checkpoint (--model): its images encoded through
    encode_image_list, turn 2 reusing the image without an encoder run; and --throughput's
    counters (the prompts fit one step: the shared image encoded once)."""
    from models.qwen2vl_fixture import build_tiny_qwen2vl

    model = build_tiny_qwen2vl(str(tmp_path / "qwen2_5_vl"), qwen2_5=True)
    d = bench(tmp_path, "vision", "--model", model, "--image-size", "112", "--repeat", "1")
    # 112 x 112 is over the fixture's max_pixels (12 merged tokens): resized to 84 x 84, 3 x 3 tokens.
    assert d["image_tokens"] == 9 and d["turn2_encoder_runs"] == [0] and d["turn2_answers_identical"]
    assert d["turn2_cached"][0] > 16 and d["medians"]["encode_s"] > 0
    # --throughput: 4 requests, 2 with an image (11 prompt tokens: vision_start, 9, vision_end).
    d = bench(
        tmp_path,
        "vision",
        "--model",
        model,
        "--image-size",
        "112",
        "--throughput",
        "4",
        "--input-len",
        "8",
        "--output-len",
        "2",
        "--repeat",
        "1",
    )
    text, distinct, same = d["rows"]
    assert distinct["prompt_tokens"] == same["prompt_tokens"] == text["prompt_tokens"] + 2 * 11
    assert (distinct["images_encoded"], distinct["mm_hits"]) == ([2], [0])
    assert (same["images_encoded"], same["mm_queries"], same["mm_hits"]) == ([1], [2], [1])
