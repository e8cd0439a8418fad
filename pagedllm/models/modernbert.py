"""ModernBERT (ModernBertModel, ModernBertForSequenceClassification) for the encoder runner:
pre-norm layers with a fused Wqkv, RoPE (a global and a local theta), GeGLU MLPs, bias-free
LayerNorms, and every `global_attn_every_n_layers`-th layer global while the others see only
tokens within local_attention / 2 of their own (both ways). Whole prompts, non-causal SDPA, no KV
cache, as models/bert.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ARCHITECTURES = ("ModernBertModel", "ModernBertForSequenceClassification")


def _norm(cfg: dict) -> nn.LayerNorm:
    return nn.LayerNorm(cfg["hidden_size"], eps=cfg.get("norm_eps", 1e-5), bias=cfg.get("norm_bias", False))


def _theta(cfg: dict, layer_type: str) -> float:
    params = (cfg.get("rope_parameters") or {}).get(layer_type)
    if params:
        return float(params["rope_theta"])
    if layer_type == "full_attention":
        return float(cfg.get("global_rope_theta", 160000.0))
    return float(cfg.get("local_rope_theta", 10000.0))


def _layer_types(cfg: dict) -> list[str]:
    every = cfg.get("global_attn_every_n_layers", 3)
    return cfg.get("layer_types") or [
        "sliding_attention" if i % every else "full_attention" for i in range(cfg["num_hidden_layers"])
    ]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, nh, T, d]; cos / sin [T, d] (NeoX halves)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class ModernBertLayer(nn.Module):
    def __init__(self, cfg: dict, index: int, layer_type: str) -> None:
        super().__init__()
        h, bias = cfg["hidden_size"], cfg.get("attention_bias", False)
        self.num_heads, self.layer_type = cfg["num_attention_heads"], layer_type
        self.attn_norm = nn.Identity() if index == 0 else _norm(cfg)
        self.attn = nn.Module()
        self.attn.Wqkv, self.attn.Wo = nn.Linear(h, 3 * h, bias=bias), nn.Linear(h, h, bias=bias)
        self.mlp_norm = _norm(cfg)
        self.mlp = nn.Module()
        self.mlp.Wi = nn.Linear(h, 2 * cfg["intermediate_size"], bias=cfg.get("mlp_bias", False))
        self.mlp.Wo = nn.Linear(cfg["intermediate_size"], h, bias=cfg.get("mlp_bias", False))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, H]; mask [B, 1, T, T] bool (True: may attend)."""
        b, t, h = x.shape
        qkv = self.attn.Wqkv(self.attn_norm(x)).view(b, t, 3, self.num_heads, h // self.num_heads)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # [B, nh, T, d]
        a = F.scaled_dot_product_attention(_rope(q, cos, sin), _rope(k, cos, sin), v, attn_mask=mask)
        x = x + self.attn.Wo(a.transpose(1, 2).reshape(b, t, h))
        inp, gate = self.mlp.Wi(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.mlp.Wo(F.gelu(inp) * gate)  # "gelu": the exact (erf) GELU


class ModernBertModel(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        for key, allowed in (("hidden_activation", "gelu"), ("classifier_activation", "gelu")):
            if cfg.get(key, allowed) != allowed:
                raise ValueError(f"ModernBERT with {key} {cfg[key]!r} is not supported ({allowed})")
        self.embeddings = nn.Module()
        self.embeddings.tok_embeddings = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.embeddings.norm = _norm(cfg)
        types = _layer_types(cfg)
        self.layers = nn.ModuleList(ModernBertLayer(cfg, i, lt) for i, lt in enumerate(types))
        self.final_norm = _norm(cfg)
        self.half_window = cfg.get("local_attention", 128) // 2
        d = cfg["hidden_size"] // cfg["num_attention_heads"]
        self.inv_freq = {
            lt: 1.0 / _theta(cfg, lt) ** (torch.arange(0, d, 2, dtype=torch.float32) / d) for lt in set(types)
        }
        self.is_classifier = any(a.endswith("ForSequenceClassification") for a in cfg.get("architectures") or [])
        self.classifier_pooling = cfg.get("classifier_pooling", "cls")
        if self.is_classifier:  # ModernBertPredictionHead (dense, GELU, norm), then the classifier
            self.head = nn.Module()
            self.head.dense = nn.Linear(cfg["hidden_size"], cfg["hidden_size"], bias=cfg.get("classifier_bias", False))
            self.head.norm = _norm(cfg)
            self.classifier = nn.Linear(cfg["hidden_size"], cfg.get("num_labels", len(cfg.get("id2label") or [0, 1])))

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, attention_mask: torch.Tensor):
        """input_ids, attention_mask [B, T] (token_type_ids unused: ModernBERT has none)."""
        t = input_ids.shape[1]
        x = self.embeddings.norm(self.embeddings.tok_embeddings(input_ids))  # [B, T, H]
        pos = torch.arange(t, device=x.device)
        keys = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, T]
        band = (pos[:, None] - pos[None, :]).abs() <= self.half_window  # [T, T]
        masks = {"full_attention": keys, "sliding_attention": keys & band}
        rope = {}
        for lt, inv in self.inv_freq.items():
            freqs = torch.outer(pos.float(), inv.to(x.device))
            emb = torch.cat((freqs, freqs), dim=-1)  # [T, d]
            rope[lt] = (emb.cos().to(x.dtype), emb.sin().to(x.dtype))
        for layer in self.layers:
            x = layer(x, masks[layer.layer_type], *rope[layer.layer_type])
        return self.final_norm(x)

    def classify(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H] -> logits [B, num_labels], pooled as classifier_pooling says."""
        if self.classifier_pooling == "mean":
            m = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * m).sum(1) / m.sum(1)
        else:
            pooled = hidden[:, 0]
        return self.classifier(self.head.norm(F.gelu(self.head.dense(pooled))))


def load_modernbert(path: str, cfg: dict, dtype: torch.dtype = torch.float32) -> ModernBertModel:
    from safetensors.torch import load_file

    model = ModernBertModel(cfg)
    state = {k.removeprefix("model."): v for k, v in load_file(f"{path}/model.safetensors").items()}
    if not model.is_classifier:
        state = {k: v for k, v in state.items() if not k.startswith(("head.", "decoder."))}
    model.load_state_dict(state, strict=True)
    return model.to(dtype).eval()
