"""Adapters made with peft for the LoRA tests: random A and (non-zero) B on a model directory,
saved in PEFT's format; and the reference, PEFT's merge_and_unload() model in transformers."""

from __future__ import annotations

import torch

ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    model_dir: str,
    out: str,
    seed: int,
    r: int = 8,
    targets=ALL_PROJ,
    use_rslora: bool = False,
    lora_alpha: int = 16,
    scale: float = 0.05,
    merged: bool = False,
    **cfg,
):
    """A PEFT LoRA adapter of the model at model_dir, every A and B drawn from N(0, scale^2),
    saved in `out` -> out, or (out, the merged model) with `merged` (saves loading it again)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(
        base,
        LoraConfig(
            r=r, lora_alpha=lora_alpha, target_modules=list(targets), use_rslora=use_rslora, lora_dropout=0.0, **cfg
        ),
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    peft_model.save_pretrained(out, safe_serialization=True)
    return (out, peft_model.merge_and_unload().eval()) if merged else out


def merged_model(model_dir: str, adapter_dir: str):
    """The reference: the base model with the adapter merged into its weights by PEFT."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()
