"""`bench perplexity --model FILE.gguf --llama-cpp`: llama-perplexity's chunks, command lines and
log parsed (samples in the tools' real formats, values by hand), and where llama.cpp's tools
are built, the default model's file requantised to Q8_0 by llama-quantize: the same token ids
as llama-tokenize's and a perplexity within 1 % of llama-perplexity's on the same file."""

from __future__ import annotations

import subprocess

import pytest

from pagedllm.benchmarks.llama_cpp_perplexity import (
    chunks,
    parse_perplexity,
    parse_token_ids,
    perplexity_command,
    tokenize_command,
)
from pagedllm.benchmarks.llama_cpp_tools import missing_tools, tool_path

# llama-perplexity: the chunk count in its log (stderr), running values on stdout, the final
# estimate on the log's last line (after the ETA, which ends without a newline)
PERPLEXITY_LOG = (
    "0.01.468.564 I perplexity: calculating perplexity over 10 chunks, n_ctx=128, batch_size=128, n_seq=1\n"
    "0.01.755.367 I perplexity: 0.29 seconds per pass - ETA 0.04.894.016 I Final estimate: PPL = 34.0704 +/- 4.09827\n"
    "[1]19.8680,[2]35.0534,[3]33.7548,\n"
)


def test_chunks_are_llama_perplexity_s():
    # 10 tokens, n_ctx 4: two whole chunks (the last 2 tokens dropped); positions 2..2 of each
    # predict the chunk's token 3: targets 3 and 7
    assert chunks(10, 4) == [(0, 4, 3), (4, 8, 7)]
    assert chunks(1024, 512) == [(0, 512, 257), (512, 1024, 769)]  # 255 targets a chunk
    with pytest.raises(ValueError, match="at least 2 \\* n_ctx tokens"):
        chunks(1023, 512)


def test_perplexity_log_and_token_ids_parsed():
    assert parse_perplexity(PERPLEXITY_LOG) == {"perplexity": 34.0704, "error": 4.09827, "chunks": 10, "n_ctx": 128}
    with pytest.raises(ValueError, match="no final estimate"):
        parse_perplexity("perplexity: you need at least 1024 tokens to evaluate perplexity with a context of 512\n")
    assert parse_token_ids("[19556, 905]\n") == [19556, 905]
    with pytest.raises(ValueError, match="no id list"):
        parse_token_ids("error: could not load model\n")


def test_command_lines():
    assert perplexity_command("/b/llama-perplexity", "m.gguf", "t.txt", 512, 2) == [
        "/b/llama-perplexity",
        "-m",
        "m.gguf",
        "-f",
        "t.txt",
        "-c",
        "512",
        "-b",
        "512",
        "-t",
        "2",
    ]
    assert tokenize_command("/b/llama-tokenize", "m.gguf", "t.txt") == [
        "/b/llama-tokenize",
        "-m",
        "m.gguf",
        "-f",
        "t.txt",
        "--ids",
        "--log-disable",
    ]


NEEDED = ("llama-quantize", "llama-perplexity", "llama-tokenize")


@pytest.mark.model
@pytest.mark.skipif(
    bool(missing_tools(NEEDED)),
    reason=f"llama.cpp's tools are not built on this machine (missing {', '.join(missing_tools(NEEDED))} "
    f"under {tool_path('llama-perplexity').parent}); `make llama-cpp` builds them (~15 min on "
    "2 cores), which CI does not do",
)
@pytest.mark.parametrize("activations", ["int8", "int16"])  # PAGEDLLM_GGUF_ACTIVATIONS: both kernels
def test_perplexity_within_one_percent_of_llama_cpp_on_the_same_file(tmp_path, monkeypatch, activations):
    from pagedllm.benchmarks import llama_cpp_perplexity
    from pagedllm.benchmarks.perplexity import DEFAULT_TEXT
    from pagedllm.models.download import find_gguf

    built = tool_path("llama-perplexity").parents[2]  # the tools stay where they are built
    monkeypatch.setattr("pagedllm.benchmarks.llama_cpp_tools.source_dir", lambda: built)
    monkeypatch.setenv("PAGEDLLM_HOME", str(tmp_path / "home"))  # the file's model directory
    monkeypatch.setenv("PAGEDLLM_GGUF_ACTIVATIONS", activations)
    path = tmp_path / "smollm2.Q8_0.gguf"
    subprocess.run(
        [str(tool_path("llama-quantize")), "--allow-requantize", str(find_gguf()), str(path), "Q8_0", "2"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    got = llama_cpp_perplexity.run(path, DEFAULT_TEXT, 512, 2)
    theirs, ours = got["rows"]
    print(got)
    assert got["ids_equal"] and got["text_tokens"] == got["llama_cpp_tokens"] > 2 * 512
    assert ours["tokens"] == theirs["tokens"] == (got["text_tokens"] // 512) * 255
    assert abs(ours["perplexity"] / theirs["perplexity"] - 1) < 0.01
