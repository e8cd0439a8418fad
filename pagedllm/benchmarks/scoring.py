"""Scoring a text by windows: the spans each window scores, the negative log-likelihood of its
tokens, and the logits of a window from pagedllm's model (through its attention metadata, the
KV cache of the window alone) and from transformers'. Used by `bench perplexity` and by its
comparison with llama.cpp's llama-perplexity."""

from __future__ import annotations

import math
import time


def windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored target) for a text of n tokens: the model sees ids[begin:end]
    and predicts targets ids[first:end], each target from the positions before it."""
    if window < 2 or not (1 <= stride < window):
        raise ValueError(f"need window >= 2 and 1 <= stride < window, got window {window}, stride {stride}")
    if n < 2:
        raise ValueError(f"the text must have at least 2 tokens, got {n}")
    out, prev_end = [], 1
    for begin in range(0, n, stride):
        end = min(begin + window, n)
        if end > prev_end:
            out.append((begin, end, prev_end))
            prev_end = end
        if end == n:
            break
    return out


def nll_sum(logits, targets) -> float:
    """logits [T, V], targets [T] -> the sum of -log softmax(logits)[target], in float64."""
    import torch

    total = 0.0
    for s in range(0, logits.shape[0], 256):  # 256 rows of float64 log-softmax at a time
        lp = torch.log_softmax(logits[s : s + 256].double(), dim=-1)
        total -= float(lp.gather(1, targets[s : s + 256, None]).sum())
    return total


def load_pagedllm(model_dir: str, dtype: str, window: int, quantization=None, group_size=None):
    """pagedllm's model, loaded as the engine loads it (packed or quantized linears, fused ops)."""
    from pagedllm.models.loader import load_model
    from pagedllm.models.model_config_loader import model_config_from_dir, set_quantization

    config = model_config_from_dir(model_dir, dtype=dtype, max_model_len=window)
    set_quantization(config, quantization, group_size, "cpu")
    return config, load_model(config)


def pagedllm_window_logits(config, model, ids: list[int], first: int, kv_cache_dtype: str = "auto"):
    """One window as a single prefill (no past) over a scratch paged KV cache of kv_cache_dtype
    (an int8 / fp8 cache: attention reads every key and value back quantized) -> float32 logits
    [len(ids) - first, V] predicting ids[first:], from positions first-1 .. len(ids)-2."""
    import torch
    from pagedllm.attention.kv_quant import resolve_kv_cache_dtype
    from pagedllm.attention.layer import attention_layers, bind_kv_cache, get_kv_cache_spec
    from pagedllm.forward_context import set_forward_context

    T, bs = len(ids), 16
    nb = -(-T // bs)
    cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, next(model.parameters()).dtype)
    specs = get_kv_cache_spec(model, bs, cache_dtype).values()
    bind_kv_cache(model, [tuple(torch.zeros(shape, dtype=dt) for shape, dt in spec.kv_tensors(nb)) for spec in specs])
    backend = next(iter(attention_layers(model).values())).backend
    meta = backend.build_metadata(
        torch.tensor([0, T], dtype=torch.int32),
        torch.tensor([T], dtype=torch.int32),
        torch.arange(nb, dtype=torch.int32)[None, :],
        torch.arange(T, dtype=torch.int64),
        bs,
    )
    with set_forward_context(meta):
        hidden = model(torch.tensor(ids, dtype=torch.int64), torch.arange(T, dtype=torch.int64))
    return torch.cat([model.compute_logits(hidden[s : min(s + 256, T - 1)]) for s in range(first - 1, T - 1, 256)])


def hf_window_logits(model, ids: list[int], first: int):
    import torch

    return model(torch.tensor([ids])).logits[0, first - 1 : -1].float()


def perplexity(window_logits, ids: list[int], spans: list[tuple[int, int, int]]) -> dict:
    """window_logits(window ids, first target relative to the window) -> logits of its targets."""
    import torch

    total, count = 0.0, 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for begin, end, first in spans:
            logits = window_logits(ids[begin:end], first - begin)
            total += nll_sum(logits, torch.tensor(ids[first:end], dtype=torch.int64))
            count += end - first
    nll = total / count
    return {"tokens": count, "nll": nll, "perplexity": math.exp(nll), "seconds": time.perf_counter() - t0}


def text_ids(tokenizer, path: str, max_tokens: int | None) -> list[int]:
    with open(path, encoding="utf-8") as f:
        ids = tokenizer(f.read())["input_ids"]
    if max_tokens is not None:
        if max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
        ids = ids[:max_tokens]
    return ids
