"""`bench perplexity --model FILE.gguf --llama-cpp`: llama.cpp's own `llama-perplexity` and
pagedllm serving the same file as it is, on the same text, context and tokens.

llama-perplexity's scheme, which pagedllm follows here: the text's tokens (BOS first where the
file asks for one) cut into whole chunks of n_ctx tokens (the remainder dropped), each chunk one
sequence from position 0 (its first token replaced by BOS where the file asks for one), and in
each only the second half scored: the logits of positions n_ctx/2 .. n_ctx-2 predict the next
token. Both sides read the text without its final newline (llama.cpp's `-f` drops it); the
token ids are compared with llama.cpp's own `llama-tokenize`.
"""

from __future__ import annotations

import ast
import math
import os
import re
import tempfile

from pagedllm.benchmarks.llama_cpp_compare import run_tool

FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)")


def chunks(n: int, ctx: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored target) per whole chunk of a text of n tokens, as
    perplexity.py's windows() gives them: the model sees ids[begin:end] and predicts ids[first:end]."""
    if ctx < 4 or n < 2 * ctx:
        raise ValueError(
            f"llama-perplexity needs n_ctx >= 4 and at least 2 * n_ctx tokens; got n_ctx {ctx}, {n} tokens"
        )
    return [(c * ctx, (c + 1) * ctx, c * ctx + ctx // 2 + 1) for c in range(n // ctx)]


def perplexity_command(tool, path, text_file, ctx: int, threads: int) -> list[str]:
    """One chunk a batch (-b n_ctx), as pagedllm runs them."""
    return [str(tool), "-m", str(path), "-f", str(text_file), "-c", str(ctx), "-b", str(ctx), "-t", str(threads)]


def tokenize_command(tool, path, text_file) -> list[str]:
    return [str(tool), "-m", str(path), "-f", str(text_file), "--ids", "--log-disable"]


def parse_perplexity(output: str) -> dict:
    """llama-perplexity's log -> {"perplexity", "error" (its +/-), "chunks", "n_ctx"}."""
    final, plan = FINAL.search(output), CHUNKS.search(output)
    if final is None or plan is None:
        raise ValueError(f"llama-perplexity printed no final estimate: {output[-500:]!r}")
    return {
        "perplexity": float(final.group(1)),
        "error": float(final.group(2)),
        "chunks": int(plan.group(1)),
        "n_ctx": int(plan.group(2)),
    }


def parse_token_ids(stdout: str) -> list[int]:
    """llama-tokenize --ids: one Python list of ids."""
    line = next((s for s in stdout.splitlines() if s.startswith("[")), None)
    if line is None:
        raise ValueError(f"llama-tokenize printed no id list: {stdout[:300]!r}")
    return [int(i) for i in ast.literal_eval(line)]


def _bos(path) -> int | None:
    """The BOS id llama.cpp puts first in each chunk, None when the file does not ask for one."""
    from pagedllm.models.gguf.reader import open_gguf

    fields = open_gguf(path).fields
    add = fields.get("tokenizer.ggml.add_bos_token")
    return int(fields["tokenizer.ggml.bos_token_id"].contents()) if add is not None and add.contents() else None


def run(path, text_path: str, ctx: int, threads: int) -> dict:
    """Both sides on the file -> {"rows": [llama.cpp, pagedllm gguf], "ids_equal", "text_tokens"}."""
    import torch
    from pagedllm.benchmarks.llama_cpp_tools import find_tool
    from pagedllm.benchmarks.scoring import load_pagedllm, pagedllm_window_logits, perplexity
    from pagedllm.models.download import resolve_model
    from transformers import AutoTokenizer

    with open(text_path, encoding="utf-8") as f:
        text = f.read().removesuffix("\n")
    with tempfile.TemporaryDirectory() as tmp:
        text_file = os.path.join(tmp, "text.txt")
        with open(text_file, "w", encoding="utf-8") as f:
            f.write(text)
        theirs_ids = parse_token_ids(run_tool(tokenize_command(find_tool("llama-tokenize"), path, text_file)))
        theirs = parse_perplexity(
            run_tool(perplexity_command(find_tool("llama-perplexity"), path, text_file, ctx, threads), with_stderr=True)
        )
    model_dir = str(resolve_model(str(path)))
    ids = AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"]
    spans = chunks(len(ids), ctx)
    bos = _bos(path)
    torch.set_num_threads(threads)
    config, model = load_pagedllm(model_dir, "float32", ctx, "gguf")

    def window(w, first):
        return pagedllm_window_logits(config, model, w if bos is None else [bos] + w[1:], first)

    ours = perplexity(window, ids, spans)
    scored = theirs["chunks"] * (ctx - 1 - ctx // 2)
    rows = [
        {
            "system": "llama.cpp (llama-perplexity)",
            "tokens": scored,
            "perplexity": theirs["perplexity"],
            "error": theirs["error"],
        },
        {"system": "pagedllm gguf", "tokens": ours["tokens"], "perplexity": ours["perplexity"], "error": float("nan")},
    ]
    for r in rows:
        r["ratio"] = r["perplexity"] / theirs["perplexity"]
        r["nll"] = math.log(r["perplexity"])
    return {"rows": rows, "ids_equal": ids == theirs_ids, "text_tokens": len(ids), "llama_cpp_tokens": len(theirs_ids)}
