"""`pagedllm bench kv-memory --per-request`: the cache one request holds at a context length,
for a hybrid (LFM2-1.2B's shape: 6 attention layers, 10 short-convolution layers) against an
all-attention model of the same hidden size, layers and KV heads (Llama-3.2-1B's shape).

The models are built on the meta device from transformers' config classes (no weights), and
the bytes are the layers' own KV cache specs: each attention layer's page (K and V of
block_size tokens) times the blocks a context of T tokens fills, plus each recurrent layer's
fixed state (`MambaSpec.state_bytes`), whatever T is.
"""

from __future__ import annotations

import argparse
import copy

# LiquidAI/LFM2-1.2B's config (hidden 2048, 16 layers, 32 heads, 8 KV heads of 64).
LFM2_1B = dict(
    vocab_size=65536,
    hidden_size=2048,
    intermediate_size=12288,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    conv_L_cache=3,
    block_auto_adjust_ff_dim=True,
    block_multiple_of=256,
    block_ffn_dim_multiplier=1.0,
    full_attn_idxs=[2, 5, 8, 10, 12, 14],
    max_position_embeddings=128000,
)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--per-request",
        action="store_true",
        help="bytes one request holds at --context-lens: a hybrid (LFM2-1.2B shape) vs Llama-3.2-1B's",
    )
    p.add_argument("--context-lens", type=int, nargs="+", default=[4096, 16384], metavar="T")


def meta_model(hf_config: dict, architecture: str, max_len: int):
    """The pagedllm model of `hf_config`, without storage (only its layers' specs are read)."""
    import torch
    from pagedllm.models.registry import get_model_class

    hf = {**hf_config, "architectures": [architecture]}
    with torch.device("meta"):
        return get_model_class(hf)(hf, max_len)


def configs() -> dict[str, tuple[dict, str]]:
    from transformers import LlamaConfig, Lfm2Config
    from pagedllm.models.random_model import SHAPES

    # A deep copy: transformers moves rope_theta into the rope_scaling dict it is given.
    llama = copy.deepcopy({k: v for k, v in SHAPES["llama-3.2-1b"].items() if k != "torch_dtype"})
    return {
        "LFM2-1.2B shape (hybrid)": (Lfm2Config(**LFM2_1B).to_dict(), "Lfm2ForCausalLM"),
        "Llama-3.2-1B shape": (LlamaConfig(**llama).to_dict(), "LlamaForCausalLM"),
    }


def request_bytes(model, context_len: int, block_size: int, dtype) -> tuple[int, int, int, int]:
    """-> (attention layers, their KV bytes at context_len, recurrent layers, their state bytes)."""
    from pagedllm.attention.layer import get_kv_cache_spec
    from pagedllm.models.layers.mamba.state_layer import state_layers

    attn = list(get_kv_cache_spec(model, block_size, dtype).values())
    states = [layer.get_kv_cache_spec(block_size, dtype) for layer in state_layers(model).values()]
    blocks = -(context_len // -block_size)
    return (len(attn), sum(s.page_size_bytes for s in attn) * blocks, len(states), sum(s.state_bytes for s in states))


def main(args: argparse.Namespace) -> int:
    import torch
    from pagedllm.benchmarks.common import command_line, machine_info, print_table, write_json

    machine = machine_info()
    print(f"command: {command_line()}")
    print(f"machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}")
    dtype, bs = torch.bfloat16, args.block_size or 16
    rows = []
    for name, (hf, arch) in configs().items():
        model = meta_model(hf, arch, max(args.context_lens))
        for t in args.context_lens:
            n_attn, kv, n_state, state = request_bytes(model, t, bs, dtype)
            rows.append(
                {
                    "model": name,
                    "tokens": t,
                    "layers": f"{n_attn} attn + {n_state} recurrent",
                    "kv_mib": kv / 2**20,
                    "state_kib": state / 2**10,
                    "total_mib": (kv + state) / 2**20,
                }
            )
    by_len = {}
    for r in rows:
        by_len.setdefault(r["tokens"], []).append(r["total_mib"])
    for r in rows:
        r["vs_attention"] = r["total_mib"] / by_len[r["tokens"]][-1]
    print(f"bfloat16 cache, block_size {bs}")
    print_table(
        rows,
        [
            ("model", "model", "s"),
            ("tokens", "tokens", "d"),
            ("layers", "layers", "s"),
            ("kv_mib", "attention KV MiB", ".1f"),
            ("state_kib", "state KiB", ".0f"),
            ("total_mib", "per request MiB", ".1f"),
            ("vs_attention", "x all-attention", ".3f"),
        ],
    )
    if args.output_json:
        write_json(args.output_json, {"rows": rows})
    return 0
