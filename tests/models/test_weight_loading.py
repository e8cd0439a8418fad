"""Layers load their own weights (models/layers/linear.py weight loaders, the model's
load_weights, one loop in models/loader.py): every tensor-parallel / pipeline rank gets exactly
the slices the regex sharding of before cut (kept here as the reference), and a checkpoint with
a missing, unexpected or misshapen tensor is refused naming it."""

import re
from types import SimpleNamespace

import pytest
import torch

from pagedllm.distributed.sharding import plan_model_shard

# Uneven heads over 2 ranks (3 KV heads), a KV head replicated on 2 ranks (1 KV head), biases.
SHAPES = [
    dict(
        hidden_size=24,
        num_attention_heads=6,
        num_key_value_heads=3,
        intermediate_size=40,
        vocab_size=51,
        num_hidden_layers=2,
        model_type="qwen2",
        attention_bias=True,
        mlp_bias=True,
    ),
    dict(
        hidden_size=16,
        num_attention_heads=4,
        num_key_value_heads=1,
        intermediate_size=30,
        vocab_size=64,
        num_hidden_layers=3,
        tie_word_embeddings=True,
    ),
]


def _checkpoint(hf: dict) -> dict[str, torch.Tensor]:
    """Random tensors under HF's Llama names."""
    g = torch.Generator().manual_seed(0)
    H, I, V = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    d = H // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"] * d, hf["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not hf.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (V, H)
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (H,),
                p + "post_attention_layernorm.weight": (H,),
                p + "self_attn.q_proj.weight": (q, H),
                p + "self_attn.k_proj.weight": (kv, H),
                p + "self_attn.v_proj.weight": (kv, H),
                p + "self_attn.o_proj.weight": (H, q),
                p + "mlp.gate_proj.weight": (I, H),
                p + "mlp.up_proj.weight": (I, H),
                p + "mlp.down_proj.weight": (H, I),
            }
        )
        if hf.get("model_type") == "qwen2" or hf.get("attention_bias"):
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (q,),
                    p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,),
                }
            )
        if hf.get("attention_bias"):
            shapes[p + "self_attn.o_proj.bias"] = (H,)
        if hf.get("mlp_bias"):
            shapes.update(
                {p + "mlp.gate_proj.bias": (I,), p + "mlp.up_proj.bias": (I,), p + "mlp.down_proj.bias": (H,)}
            )
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


# --- the reference: the loader's name map and parallel_llama.shard_weight as they were ---
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def _reference(ckpt: dict, shard) -> dict[str, torch.Tensor]:
    tp, d = shard.tp, shard.head_dim
    out, parts = {}, {}
    for name, t in ckpt.items():
        m = re.match(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$", name)
        if m is None:
            target = name.removeprefix("model.")
            if target in ("embed_tokens.weight", "lm_head.weight"):
                if shard.is_first_stage:
                    out[target] = t[tp.vocab.start : tp.vocab.stop]
            elif shard.is_last_stage:
                out[target] = t
            continue
        idx, mod, kind = int(m.group(1)), m.group(2), m.group(3)
        if idx not in shard.layers:
            continue
        fused, part = _FUSED.get(mod, (mod, None))
        if mod == "self_attn.o_proj" and kind == "weight":
            t = t[:, tp.q_heads.start * d : tp.q_heads.stop * d]
        elif mod == "mlp.down_proj" and kind == "weight":
            t = t[:, tp.intermediate.start : tp.intermediate.stop]
        elif fused == "self_attn.qkv_proj":
            heads = tp.q_heads if part == 0 else tp.kv_heads
            t = t[heads.start * d : heads.stop * d]
        elif fused == "mlp.gate_up_proj":
            t = t[tp.intermediate.start : tp.intermediate.stop]
        target = f"layers.{idx}.{fused}.{kind}"
        if part is None:
            out[target] = t
        else:
            parts.setdefault(target, {})[part] = t
    for target, p in parts.items():
        out[target] = torch.cat([p[i] for i in sorted(p)])
    return out


@pytest.mark.parametrize("hf", SHAPES)
@pytest.mark.parametrize("tp_size, pp_size", [(1, 1), (2, 1), (2, 2), (1, 2)])
def test_every_rank_loads_the_slices_of_the_regex_sharding(hf, tp_size, pp_size):
    from pagedllm.models.loader import load_weights
    from pagedllm.models.llama import LlamaForCausalLM

    ckpt = _checkpoint(hf)
    for rank in range(tp_size * pp_size):
        shard = plan_model_shard(hf, tp_size, pp_size, rank)
        parallel = SimpleNamespace(shard=shard, tp=SimpleNamespace(size=tp_size))  # no collectives here
        model = LlamaForCausalLM(hf, 32, parallel)
        load_weights(model, ckpt.items(), "ckpt")
        ref = _reference(ckpt, shard)
        got = {n: p for n, p in model.named_parameters()}
        if model.tie_word_embeddings and shard.is_first_stage:
            assert model.lm_head.weight is model.embed_tokens.weight
            got.pop("lm_head.weight", None)
        assert sorted(got) == sorted(ref), f"rank {rank}"
        for name, t in ref.items():
            assert torch.equal(got[name], t), f"rank {rank}: {name}"


def _tiny_dir(tmp_path, edit):
    """The random 'tiny' model, its checkpoint edited by edit(dict of tensors)."""
    from safetensors.torch import load_file, save_file

    from pagedllm.models.random_model import make_random_model

    out = make_random_model(tmp_path / "tiny", "tiny")
    path = out / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return str(out)


def _load(model_dir):
    from pagedllm.models.loader import load_model
    from pagedllm.models.model_config_loader import model_config_from_dir

    return load_model(model_config_from_dir(model_dir))


def test_missing_unexpected_and_misshapen_weights_are_named(tmp_path):
    model_dir = _tiny_dir(tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"weights missing from .*layers\.1\.self_attn\.qkv_proj\.weight"):
        _load(model_dir)

    def add(t):
        t["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)

    with pytest.raises(ValueError, match=r"unexpected weight 'model\.layers\.0\.mlp\.extra_proj\.weight'"):
        _load(_tiny_dir(tmp_path, add))

    def shrink(t):
        t["model.norm.weight"] = t["model.norm.weight"][:-1].clone()

    with pytest.raises(ValueError, match=r"weight 'model\.norm\.weight': shape \(127,\) does not fit"):
        _load(_tiny_dir(tmp_path, shrink))
