"""EncoderRunner: an encoder-only model (BERT, XLM-RoBERTa, ModernBERT) over whole prompts, one padded batch per call.

Texts (or text pairs, for a cross-encoder) are tokenized with the model's tokenizer (pairs get
token-type ids 0 / 1), truncated to the sentence-transformers max_seq_length (else the model's
max_position_embeddings), run in one forward with bidirectional attention, then pooled as the
sentence-transformers config says (modules.json + 1_Pooling/config.json: CLS or mean, and
Normalize), or classified by the sequence-classification head."""
from __future__ import annotations

import json
import os
from typing import Sequence

import torch
import torch.nn.functional as F

from pagedllm.config import PoolerConfig
from pagedllm.models import bert, modernbert

# architecture -> its loader
_LOADERS = {**{a: bert.load_bert for a in bert.ARCHITECTURES},
            **{a: modernbert.load_modernbert for a in modernbert.ARCHITECTURES}}


class EncoderRunner:
    def __init__(self, path: str, dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoTokenizer
        with open(os.path.join(path, "config.json")) as f:
            self.hf_config = json.load(f)
        archs = [a for a in self.hf_config.get("architectures") or [] if a in _LOADERS]
        if not archs:
            raise ValueError(f"architecture {self.hf_config.get('architectures')} in {path} is not an encoder "
                             f"pagedllm runs ({', '.join(_LOADERS)})")
        self.model = _LOADERS[archs[0]](path, self.hf_config, dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.pooler_config = PoolerConfig.from_dir(path, encoder=True)
        if not os.path.isfile(os.path.join(path, "modules.json")):   # a plain encoder: vLLM's default
            self.pooler_config = PoolerConfig(pooling_type="CLS", normalize=True)
        st_path = os.path.join(path, "sentence_bert_config.json")
        limit = self.hf_config["max_position_embeddings"]
        if os.path.isfile(st_path):
            with open(st_path) as f:
                limit = min(limit, json.load(f).get("max_seq_length", limit))
        self.max_length = limit

    @property
    def is_classifier(self) -> bool:
        return self.model.is_classifier

    def _forward(self, texts: Sequence[str], pairs: Sequence[str] | None = None):
        if not texts:
            raise ValueError("input must hold at least one text")
        enc = self.tokenizer(list(texts), list(pairs) if pairs is not None else None, padding=True,
                             truncation=True, max_length=self.max_length, return_tensors="pt")
        mask = enc["attention_mask"]                                                      # [B, T]
        types = enc.get("token_type_ids", torch.zeros_like(mask))
        with torch.inference_mode():
            hidden = self.model(enc["input_ids"], types, mask)                           # [B, T, H]
        return hidden, mask, int(mask.sum())

    def embed(self, texts: Sequence[str]) -> tuple[torch.Tensor, int]:
        """-> ([len(texts), H] float32 pooled vectors, number of prompt tokens)."""
        hidden, mask, n = self._forward(texts)
        if self.pooler_config.pooling_type == "CLS":
            pooled = hidden[:, 0]
        elif self.pooler_config.pooling_type == "MEAN":
            m = mask.unsqueeze(-1).to(hidden.dtype)                                       # [B, T, 1]
            pooled = (hidden * m).sum(1) / m.sum(1)
        else:   # LAST: each row's last real token
            pooled = hidden[torch.arange(hidden.shape[0]), mask.sum(1) - 1]
        pooled = pooled.float()
        return (F.normalize(pooled, p=2, dim=-1) if self.pooler_config.normalize else pooled), n

    def classify(self, texts: Sequence[str], pairs: Sequence[str] | None = None) -> tuple[torch.Tensor, int]:
        """-> ([len(texts), num_labels] float32 logits, number of prompt tokens)."""
        if not self.is_classifier:
            raise ValueError("this model has no classification head (*ForSequenceClassification)")
        hidden, mask, n = self._forward(texts, pairs)
        with torch.inference_mode():
            return self.model.classify(hidden, mask).float(), n
