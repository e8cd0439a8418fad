"""Shapes read from a config.json (a dict), by the rules transformers applies; torch-free, so
that the config, the sharding plan, the models and the benchmarks all read them one way."""
from __future__ import annotations


def head_dim_of(hf_config: dict) -> int:
    """config.json's head_dim, else hidden_size / num_attention_heads."""
    return hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]
