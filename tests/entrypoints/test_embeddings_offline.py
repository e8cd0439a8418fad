"""LLM(model, runner="pooling").embed(): each prompt's pooled final hidden state equals
transformers' (LlamaModel's last_hidden_state, after the final norm) within 1e-4, pooled as the
directory says: last token by default, the mean where a sentence-transformers config asks for it;
with chunked prefill (a small token budget), batching, and (last token) a prefix-cache hit."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from pagedllm.config import PoolerConfig
from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams

# Longer than the token budget (chunked), shorter, and a one-token prompt, in one batch.
PROMPTS = [[5, 17, 33, 101, 7, 250, 9, 64] * 5, [3, 4, 5], list(range(3, 60)), [42]]


@pytest.fixture(scope="module")
def tiny_dir():
    from pagedllm.models.random_model import random_model_dir

    return str(random_model_dir("random:tiny"))


@pytest.fixture(scope="module")
def hidden(tiny_dir):
    """prompt index -> transformers' final hidden states [len, H]."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]


def st_dir(src, dst, pooling_mode: str, normalize: bool) -> str:
    """A copy of the model directory with a sentence-transformers pooling config."""
    shutil.copytree(src, dst)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (dst / "modules.json").write_text(json.dumps(modules))
    (dst / "1_Pooling").mkdir()
    (dst / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": 128,
                "pooling_mode_cls_token": False,
                "pooling_mode_mean_tokens": False,
                "pooling_mode_lasttoken": False,
                pooling_mode: True,
            }
        )
    )
    return str(dst)


def check(outs, expected):
    assert len(outs) == len(expected)
    for out, (i, ref) in zip(outs, expected):
        got = torch.tensor(out.outputs.embedding)
        assert got.shape == ref.shape and out.prompt_token_ids == PROMPTS[i]
        assert torch.allclose(got, ref, atol=1e-4, rtol=0), (i, (got - ref).abs().max())


def test_last_token_default_chunked_and_cached(tiny_dir, hidden):
    assert PoolerConfig.from_dir(tiny_dir) == PoolerConfig("LAST", True)
    llm = LLM(tiny_dir, runner="pooling", max_num_batched_tokens=16, block_size=4)
    expected = [(i, F.normalize(h[-1], dim=-1)) for i, h in enumerate(hidden)]
    check(llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False), expected)
    again = llm.embed([{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[2]}], use_tqdm=False)
    assert again[0].num_cached_tokens > 0 and again[1].num_cached_tokens > 0  # prefix-cache hits
    check(again, [expected[0], expected[2]])
    with pytest.raises(ValueError, match="runner='generate'"):
        llm.generate([PROMPTS[1]], SamplingParams(max_tokens=2))


def test_mean_from_sentence_transformers_config(tiny_dir, hidden, tmp_path):
    d = st_dir(tiny_dir, tmp_path / "st-mean", "pooling_mode_mean_tokens", normalize=False)
    assert PoolerConfig.from_dir(d) == PoolerConfig("MEAN", False)
    # The means' sums run across chunks (budget 16 < 40, 57 tokens).
    llm = LLM(d, runner="pooling", max_num_batched_tokens=16, block_size=4)
    assert not llm.llm_engine.config.cache_config.enable_prefix_caching  # a mean needs every token
    check(
        llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False),
        [(i, h.mean(0)) for i, h in enumerate(hidden)],
    )


def test_bad_configs(tiny_dir, tmp_path):
    d = st_dir(tiny_dir, tmp_path / "st-cls", "pooling_mode_cls_token", normalize=True)
    with pytest.raises(ValueError, match="pooling_mode_cls_token"):
        LLM(d, runner="pooling")
    with pytest.raises(ValueError, match="runner must be"):
        LLM(tiny_dir, runner="embed")
    llm = LLM(tiny_dir, max_num_seqs=2, num_gpu_blocks=8)
    with pytest.raises(ValueError, match="runner='pooling'"):
        llm.embed(["w5 w6"])
