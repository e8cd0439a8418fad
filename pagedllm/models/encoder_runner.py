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
_LOADERS = {
    **{a: bert.load_bert for a in bert.ARCHITECTURES},
    **{a: modernbert.load_modernbert for a in modernbert.ARCHITECTURES},
}


def is_encoder_dir(path: str | os.PathLike) -> bool:
    """Whether an HF model directory holds an encoder this runner serves (by its config's architectures)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            archs = json.load(f).get("architectures") or []
    except (OSError, ValueError):
        return False
    return any(a in _LOADERS for a in archs)


class EncoderRunner:
    def __init__(self, path: str, dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoTokenizer

        with open(os.path.join(path, "config.json")) as f:
            self.hf_config = json.load(f)
        archs = [a for a in self.hf_config.get("architectures") or [] if a in _LOADERS]
        if not archs:
            raise ValueError(
                f"architecture {self.hf_config.get('architectures')} in {path} is not an encoder "
                f"pagedllm runs ({', '.join(_LOADERS)})"
            )
        self.model = _LOADERS[archs[0]](path, self.hf_config, dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.pooler_config = PoolerConfig.from_dir(path, encoder=True)
        if not os.path.isfile(os.path.join(path, "modules.json")):  # a plain encoder: vLLM's default
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
        enc = self.tokenizer(
            list(texts),
            list(pairs) if pairs is not None else None,
            padding=True,
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        )
        mask = enc["attention_mask"]  # [B, T]
        types = enc.get("token_type_ids", torch.zeros_like(mask))
        return self._run(enc["input_ids"], types, mask), mask, int(mask.sum())

    def _run(self, ids: torch.Tensor, types: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(ids, types, mask)  # [B, T, H]

    def pad(self, ids: Sequence[Sequence[int]], type_ids: Sequence[Sequence[int]] | None = None):
        """Token id lists (and their token-type ids) -> padded [B, T] ids, types and attention mask."""
        b, t = len(ids), max(map(len, ids))
        pad_id = self.tokenizer.pad_token_id or 0
        out_ids = torch.full((b, t), pad_id, dtype=torch.long)  # [B, T]
        types = torch.zeros((b, t), dtype=torch.long)
        mask = torch.zeros((b, t), dtype=torch.long)
        for i, row in enumerate(ids):  # a loop over requests only
            out_ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
            if type_ids is not None:
                types[i, : len(row)] = torch.tensor(type_ids[i])
        return out_ids, types, mask

    def embed_ids(self, ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Tokenized prompts (unpadded, within max_length) -> [len(ids), H] float32 pooled vectors."""
        out_ids, types, mask = self.pad(ids)
        return self._pool(self._run(out_ids, types, mask), mask)

    def classify_ids(self, ids: Sequence[Sequence[int]], type_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Tokenized texts or pairs with their token-type ids -> [len(ids), num_labels] float32 logits."""
        if not self.is_classifier:
            raise ValueError("this model has no classification head (*ForSequenceClassification)")
        out_ids, types, mask = self.pad(ids, type_ids)
        hidden = self._run(out_ids, types, mask)
        with torch.inference_mode():
            return self.model.classify(hidden, mask).float()

    def embed(self, texts: Sequence[str]) -> tuple[torch.Tensor, int]:
        """-> ([len(texts), H] float32 pooled vectors, number of prompt tokens)."""
        hidden, mask, n = self._forward(texts)
        return self._pool(hidden, mask), n

    def _pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H], mask [B, T] -> [B, H] float32, as the sentence-transformers config says."""
        if self.pooler_config.pooling_type == "CLS":
            pooled = hidden[:, 0]
        elif self.pooler_config.pooling_type == "MEAN":
            m = mask.unsqueeze(-1).to(hidden.dtype)  # [B, T, 1]
            pooled = (hidden * m).sum(1) / m.sum(1)
        else:  # LAST: each row's last real token
            pooled = hidden[torch.arange(hidden.shape[0]), mask.sum(1) - 1]
        pooled = pooled.float()
        return F.normalize(pooled, p=2, dim=-1) if self.pooler_config.normalize else pooled

    def classify(self, texts: Sequence[str], pairs: Sequence[str] | None = None) -> tuple[torch.Tensor, int]:
        """-> ([len(texts), num_labels] float32 logits, number of prompt tokens)."""
        if not self.is_classifier:
            raise ValueError("this model has no classification head (*ForSequenceClassification)")
        hidden, mask, n = self._forward(texts, pairs)
        with torch.inference_mode():
            return self.model.classify(hidden, mask).float(), n
