"""Tiny random-weight encoders made and saved by transformers (the tests' reference on the same
weights): BERT, XLM-RoBERTa, ModernBERT, with an embedding or a sequence-classification head;
and all-MiniLM-L6-v2 (the ready model) with sentence-transformers' encode of it, the reference."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pagedllm.models.download import MINILM_MODEL, ensure_ready_model


def minilm_dir() -> str:
    return str(ensure_ready_model(MINILM_MODEL, progress=False))


def st_encoder():
    """texts -> sentence-transformers' all-MiniLM-L6-v2 vectors ([N, 384] float32 tensor, normalised)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(minilm_dir(), device="cpu")
    return lambda texts: model.encode(texts, convert_to_tensor=True).float()


def random_encoder(tmp_path, arch: str, pooling: str | None, num_labels: int = 3, init_range: float = 0.02):
    """A tiny random BERT or XLM-RoBERTa made and saved by transformers (the reference), with the
    MiniLM tokenizer (so pad id 0) and, for an embedding model, a sentence-transformers pooling config.
    init_range: the weights' standard deviation (a wider one spreads a classifier's scores apart)."""
    import transformers

    src = ensure_ready_model(MINILM_MODEL, progress=False)
    family = {
        "XLMRoberta": (transformers.XLMRobertaConfig, {"type_vocab_size": 1}),
        # 3 layers, the middle one local with a window of +-4 tokens; classifier mean pooling
        "ModernBert": (
            transformers.ModernBertConfig,
            {
                "num_hidden_layers": 3,
                "global_attn_every_n_layers": 2,
                "local_attention": 8,
                "classifier_pooling": "mean",
            },
        ),
    }
    config_class, extra = next((v for k, v in family.items() if arch.startswith(k)), (transformers.BertConfig, {}))
    cfg = config_class(
        **{
            "vocab_size": 30522,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 128,
            "max_position_embeddings": 130,
            "num_labels": num_labels,
            "pad_token_id": 0,
            "architectures": [arch],
            "initializer_range": init_range,
            **extra,
        }
    )
    torch.manual_seed(0)
    model = getattr(transformers, arch)(cfg).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    transformers.AutoTokenizer.from_pretrained(src).save_pretrained(tmp_path)
    if pooling:
        (Path(tmp_path) / "modules.json").write_text(
            json.dumps(
                [
                    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                ]
            )
        )
        (Path(tmp_path) / "1_Pooling").mkdir()
        (Path(tmp_path) / "1_Pooling" / "config.json").write_text(json.dumps({pooling: True}))
    return model, transformers.AutoTokenizer.from_pretrained(tmp_path)
