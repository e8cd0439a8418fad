"""BERT and XLM-RoBERTa (their embedding models and sequence-classification heads): an
encoder-only model, run over each whole prompt in one step with bidirectional (non-causal) SDPA
and no KV cache.

An encoder request is prefill-only: every token attends to every token of its own prompt and
nothing is decoded afterwards, so there is nothing to cache and no paging to do. A batch is
padded to its longest prompt; the padding is masked out of the keys (attention_mask) and out of
the pooling (models/encoder_pooling.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ARCHITECTURES = (
    "BertModel",
    "BertForSequenceClassification",
    "XLMRobertaModel",
    "XLMRobertaForSequenceClassification",
    "RobertaModel",
    "RobertaForSequenceClassification",
)


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        h = cfg["hidden_size"]
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], h)
        self.position_embeddings = nn.Embedding(cfg["max_position_embeddings"], h)
        self.token_type_embeddings = nn.Embedding(cfg.get("type_vocab_size", 2), h)
        self.LayerNorm = nn.LayerNorm(h, eps=cfg.get("layer_norm_eps", 1e-12))
        # (XLM-)RoBERTa numbers a row's real tokens from pad_token_id + 1 (padding keeps pad_token_id).
        self.pad_offset = cfg.get("pad_token_id", 1) if cfg.get("model_type") in ("roberta", "xlm-roberta") else None

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        if self.pad_offset is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)  # [T]
        else:
            real = (input_ids != self.pad_offset).long()
            positions = torch.cumsum(real, 1) * real + self.pad_offset  # [B, T]
        if self.token_type_embeddings.num_embeddings == 1:  # RoBERTa: one segment type for pairs too
            token_type_ids = torch.zeros_like(token_type_ids)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)  # [B, T, H]
        return self.LayerNorm(x + self.position_embeddings(positions))


class BertLayer(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        h, eps = cfg["hidden_size"], cfg.get("layer_norm_eps", 1e-12)
        self.num_heads = cfg["num_attention_heads"]
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.attn_out, self.attn_norm = nn.Linear(h, h), nn.LayerNorm(h, eps=eps)
        self.intermediate = nn.Linear(h, cfg["intermediate_size"])
        self.output, self.out_norm = nn.Linear(cfg["intermediate_size"], h), nn.LayerNorm(h, eps=eps)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, H]; key_mask [B, 1, 1, T] bool (True: a real token)."""
        b, t, h = x.shape

        def heads(lin: nn.Linear) -> torch.Tensor:
            return lin(x).view(b, t, self.num_heads, h // self.num_heads).transpose(1, 2)  # [B, nh, T, d]

        a = F.scaled_dot_product_attention(
            heads(self.query), heads(self.key), heads(self.value), attn_mask=key_mask, is_causal=False
        )
        x = self.attn_norm(x + self.attn_out(a.transpose(1, 2).reshape(b, t, h)))
        # BERT's "gelu" is the exact (erf) GELU.
        return self.out_norm(x + self.output(F.gelu(self.intermediate(x))))


class BertModel(nn.Module):
    """-> the last layer's hidden states [B, T, H]; with a classifier head, also its logits."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        if cfg.get("hidden_act", "gelu") != "gelu" or cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                f"BERT with hidden_act {cfg.get('hidden_act')!r} / position_embedding_type "
                f"{cfg.get('position_embedding_type')!r} is not supported (gelu, absolute)"
            )
        self.embeddings = BertEmbeddings(cfg)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.is_classifier = any(a.endswith("ForSequenceClassification") for a in cfg.get("architectures") or [])
        # BERT: BertPooler (dense + tanh over [CLS]) then the classifier; RoBERTa's classification
        # head is the same (dense, tanh, out_proj), loaded into the same two layers.
        if self.is_classifier:
            h = cfg["hidden_size"]
            self.pooler = nn.Linear(h, h)
            self.classifier = nn.Linear(h, cfg.get("num_labels", len(cfg.get("id2label") or {0: 0, 1: 1})))

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, attention_mask: torch.Tensor):
        """input_ids, token_type_ids, attention_mask: [B, T] (mask 1 for tokens, 0 for padding)."""
        x = self.embeddings(input_ids, token_type_ids)
        key_mask = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, T]
        for layer in self.layers:
            x = layer(x, key_mask)
        return x

    def classify(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H] -> logits [B, num_labels] from the [CLS] token."""
        return self.classifier(torch.tanh(self.pooler(hidden[:, 0])))


# HF checkpoint names -> this module's (the "bert." prefix is dropped first).
_RENAMES = (
    ("encoder.layer.", "layers."),
    (".attention.self.", "."),
    (".attention.output.dense.", ".attn_out."),
    (".attention.output.LayerNorm.", ".attn_norm."),
    (".intermediate.dense.", ".intermediate."),
    (".output.dense.", ".output."),
    (".output.LayerNorm.", ".out_norm."),
    ("pooler.dense.", "pooler."),
    ("classifier.dense.", "pooler."),
    ("classifier.out_proj.", "classifier."),
)


def hf_to_local(name: str) -> str:
    for prefix in ("bert.", "roberta."):
        name = name.removeprefix(prefix)
    for old, new in _RENAMES:
        name = name.replace(old, new)
    return name


def load_bert(path: str, cfg: dict, dtype: torch.dtype = torch.float32) -> BertModel:
    """The model from an HF directory's model.safetensors (every weight must be there)."""
    from safetensors.torch import load_file

    model = BertModel(cfg)
    state = {
        hf_to_local(k): v for k, v in load_file(f"{path}/model.safetensors").items() if not k.endswith("position_ids")
    }
    if not model.is_classifier:  # an embedding model's checkpoint may carry an unused pooler
        state = {k: v for k, v in state.items() if not k.startswith("pooler.")}
    model.load_state_dict(state, strict=True)
    return model.to(dtype).eval()
