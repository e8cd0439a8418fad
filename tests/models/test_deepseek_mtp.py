"""DeepSeek-V3's MTP module (models/deepseek_mtp.py) against its equations written here in torch:

    h'_i = eh_proj([RMSNorm_e(Emb(t_{i+1})); RMSNorm_h(h_i)]),  h''_i = TRM(h'_{<=i}),
    logits_i = head(RMSNorm(h''_i))   (predicting t_{i+2})

with TRM transformers' own DeepseekV3DecoderLayer (MLA + MoE, eager, causal) on the same
weights, and h_i the last main-model layer's output (before the final norm) of transformers'
DeepseekV3ForCausalLM. transformers has no MTP: the test writes the module's tensors into the
checkpoint under model.layers.{num_hidden_layers}.* (the names DeepSeek-V3 ships); the engine's
module must load every one of its parameters from them and nothing of the main model's. It
runs over the paged latent cache in three steps: a prefill chunk, a chunk with cached past,
and a decode (absorbed attention)."""

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from models.test_deepseek_v3 import make_deepseek_dir

BLOCK = 4


def rms_norm(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def add_mtp_layer(out, model):
    """Random MTP tensors (checkpoint names) appended to out/model.safetensors; returns them
    and the transformers decoder layer holding the block's weights."""
    import copy

    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    cfg = copy.deepcopy(model.config)
    cfg._attn_implementation = "eager"  # the block runs alone, with the causal mask given here
    n, H, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    g = torch.Generator().manual_seed(7)
    block = DeepseekV3DecoderLayer(cfg, layer_idx=n).float().eval()  # layer n >= first dense: MoE
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(
                1 + 0.1 * torch.randn(p.shape, generator=g)
                if "norm" in name
                else 0.1 * torch.randn(p.shape, generator=g)
            )
        block.mlp.gate.e_score_correction_bias.copy_(0.05 * torch.randn(cfg.n_routed_experts, generator=g))
    ckpt = {}
    for name, t in block.state_dict().items():
        if name == "mlp.experts.gate_up_proj":  # transformers' stacked experts -> per expert
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2)
                ckpt[f"mlp.experts.{e}.gate_proj.weight"], ckpt[f"mlp.experts.{e}.up_proj.weight"] = gate, up
        elif name == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                ckpt[f"mlp.experts.{e}.down_proj.weight"] = t[e]
        else:
            ckpt[name] = t
    extra = {
        "enorm.weight": 1 + 0.1 * torch.randn(H, generator=g),
        "hnorm.weight": 1 + 0.1 * torch.randn(H, generator=g),
        "eh_proj.weight": 0.1 * torch.randn(H, 2 * H, generator=g),
        "shared_head.norm.weight": 1 + 0.1 * torch.randn(H, generator=g),
        "shared_head.head.weight": 0.1 * torch.randn(V, H, generator=g),
        "embed_tokens.weight": model.model.embed_tokens.weight.detach().clone(),
    }
    ckpt.update(extra)
    tensors = load_file(out / "model.safetensors")
    tensors.update({f"model.layers.{n}.{k}": v.contiguous() for k, v in ckpt.items()})
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return extra, block


def reference_logits(model, block, extra, tokens):
    """logits_i for i = 0 .. len(tokens) - 2 from the equations above."""
    cfg = model.config
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(lambda m, i, o: captured.setdefault("h", o))
    with torch.no_grad():
        model(torch.tensor([tokens[:-1]]))
        hook.remove()
        h = captured["h"][0]  # [T, H], before the final norm
        T = h.shape[0]
        e = rms_norm(extra["embed_tokens.weight"][tokens[1:]], extra["enorm.weight"], cfg.rms_norm_eps)
        x = torch.cat((e, rms_norm(h, extra["hnorm.weight"], cfg.rms_norm_eps)), -1) @ extra["eh_proj.weight"].T
        pos = torch.arange(T)[None]
        causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
        x = block(
            x[None], attention_mask=causal, position_ids=pos, position_embeddings=model.model.rotary_emb(x[None], pos)
        )[0]
        return rms_norm(x, extra["shared_head.norm.weight"], cfg.rms_norm_eps) @ extra["shared_head.head.weight"].T, h


def test_mtp_logits_equal_the_equations(tmp_path):
    import json

    from pagedllm.attention.layer import bind_kv_cache, get_kv_cache_spec
    from pagedllm.forward_context import set_forward_context
    from pagedllm.models.deepseek_mtp import DeepSeekMTP
    from pagedllm.models.loader import iter_weights, load_weights

    model = make_deepseek_dir(tmp_path)
    extra, block = add_mtp_layer(tmp_path, model)
    tokens = torch.randint(3, model.config.vocab_size, (15,), generator=torch.Generator().manual_seed(3)).tolist()
    ref, h = reference_logits(model, block, extra, tokens)
    T = h.shape[0]

    hf = json.loads((tmp_path / "config.json").read_text())
    mtp = DeepSeekMTP(hf, max_positions=64)
    load_weights(mtp, iter_weights(str(tmp_path)), str(tmp_path))  # every parameter, or ValueError
    mtp = mtp.eval()
    specs = list(get_kv_cache_spec(mtp, BLOCK, torch.float32).values())
    assert len(specs) == 1  # one latent cache: the MTP module's own MLA layer
    num_blocks = 8
    bind_kv_cache(mtp, [tuple(torch.zeros(s) for s in specs[0].kv_shapes(num_blocks))])
    block_table = np.array([[5, 2, 7, 1]], dtype=np.int32)  # one request, shuffled blocks
    backend = mtp.layers[str(hf["num_hidden_layers"])].self_attn.mla_attn.backend
    next_ids = torch.tensor(tokens[1:])
    for lo, hi in [(0, 6), (6, T - 1), (T - 1, T)]:  # prefill, chunk with past, decode
        pos = torch.arange(lo, hi)
        slots = torch.from_numpy(block_table[0, pos.numpy() // BLOCK].astype(np.int64) * BLOCK + pos.numpy() % BLOCK)
        meta = backend.build_metadata(
            torch.tensor([0, hi - lo], dtype=torch.int32),
            torch.tensor([hi], dtype=torch.int32),
            torch.from_numpy(block_table),
            slots,
            BLOCK,
        )
        with torch.no_grad(), set_forward_context(meta):
            logits = mtp.compute_logits(mtp(h[lo:hi], next_ids[lo:hi], pos))
        torch.testing.assert_close(logits, ref[lo:hi], atol=1e-4, rtol=1e-4)
