"""FP8 checkpoints (DeepSeek-V3's fine-grained FP8: e4m3 weights, a float32 `weight_scale_inv`
per [128, 128] block, `quantization_config` quant_method fp8): a tiny random Llama quantized
here block-wise (k/v projections and the MLP's 256 rows leave partial blocks), written as
DeepSeek writes it, loaded by the engine (upcast at load on the CPU) and compared with
transformers running the same weights dequantized: greedy token for token."""

import json

import pytest
import torch
from fp8_reference import dequantize_blocks
from greedy_utils import assert_greedy_equal, hf_greedy
from safetensors.torch import load_file, save_file

from pagedllm.models.layers.quantization.fp8 import dequantize_block_fp8, fp8_block_size, upcast_fp8_weights
from pagedllm.models.layers.fp8_linear import quantize_block_fp8

BLOCK = (128, 128)
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    """(the FP8 checkpoint's directory, the same model dequantized as a plain directory)."""
    from pagedllm.models.random_model import make_random_model

    root = tmp_path_factory.mktemp("fp8")
    plain = make_random_model(root / "plain", "tiny", seed=3, initializer_range=0.2)
    fp8 = make_random_model(root / "fp8", "tiny", seed=3, initializer_range=0.2)
    tensors = load_file(plain / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, t in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in QUANTIZED:
            q, s = quantize_block_fp8(t, BLOCK)
            quantized[name], quantized[name + "_scale_inv"] = q, s
            dequantized[name] = dequantize_blocks(q, s, BLOCK).float()  # independent of the loader
        else:
            quantized[name] = dequantized[name] = t
    save_file(quantized, fp8 / "model.safetensors")
    save_file(dequantized, plain / "model.safetensors")
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    }
    (fp8 / "config.json").write_text(json.dumps(cfg))
    return fp8, plain


def test_dequantize_matches_the_blocks():
    w = torch.randn(200, 300)
    q, s = quantize_block_fp8(w, BLOCK)
    back = dequantize_block_fp8(q, s, BLOCK, torch.float32)
    assert back.shape == w.shape
    # e4m3 keeps 3 mantissa bits: within 2^-4 of each value (or of the block's smallest normal)
    assert torch.all((back - w).abs() <= w.abs() * 2**-4 + s.max() * 2**-6)
    assert torch.equal(back, dequantize_blocks(q, s, BLOCK).float())
    with pytest.raises(ValueError, match="weight_scale_inv"):
        dequantize_block_fp8(q, s[:1], BLOCK, torch.float32)


def test_stream_joins_weights_and_scales_in_any_order():
    q, s = quantize_block_fp8(torch.randn(64, 64), BLOCK)
    stream = [("a.weight_scale_inv", s), ("norm.weight", torch.ones(3)), ("a.weight", q)]
    out = dict(upcast_fp8_weights(iter(stream), BLOCK, torch.float32))
    assert set(out) == {"a.weight", "norm.weight"} and out["a.weight"].dtype == torch.float32
    with pytest.raises(ValueError, match="without"):
        list(upcast_fp8_weights(iter([("b.weight", q)]), BLOCK, torch.float32))


def test_config_is_read_or_refused():
    assert fp8_block_size({}) is None
    assert fp8_block_size({"quantization_config": {"quant_method": "fp8"}}) == (128, 128)
    with pytest.raises(ValueError, match="activation_scheme"):
        fp8_block_size({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}})


def test_fp8_checkpoint_greedy_equals_transformers_on_dequantized_weights(fp8_model):
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams

    fp8, plain = fp8_model
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (4, 33, 17)]
    llm = LLM(str(fp8), max_model_len=128)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        use_tqdm=False,
    )
    hf = AutoModelForCausalLM.from_pretrained(plain).eval()
    assert_greedy_equal(outs, hf_greedy(hf, prompts, 10), "fp8 checkpoint")
