"""--quantization int4 through the engine against transformers on weights quantised by hand.

The reference rounds the float checkpoint's weights by the documented scheme, written here from
its words and not from pagedllm's quantizer: each linear's rows in groups of 32 input features,
a scale (max - min) / 15 and a min per group, q = round((w - min) / scale) in 0..15, w = q scale
+ min; the LM head symmetric int8 in groups of 32 (scale amax / 127, q in -127..127). Those float
weights go into transformers, whose greedy tokens the engine's int4 model must give.
"""

import torch

from greedy_utils import assert_greedy_equal, hf_greedy

MAX_TOKENS = 12
GROUP = 32


def _int4_by_hand(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape  # [N, K] -> groups [N, K/32, 32]
    g = w.double().view(n, k // GROUP, GROUP)
    lo, hi = g.amin(dim=2, keepdim=True), g.amax(dim=2, keepdim=True)
    scale = ((hi - lo) / 15).float().double()  # the engine holds scales and mins in float32
    lo = lo.float().double()
    q = torch.round((g - lo) / scale).clamp(0, 15)
    return (q * scale + lo).view(n, k).float()


def _int8_lm_head_by_hand(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    g = w.double().view(n, k // GROUP, GROUP)
    scale = (g.abs().amax(dim=2, keepdim=True) / 127).float().double()
    return (torch.round(g / scale).clamp(-127, 127) * scale).view(n, k).float()


def test_int4_engine_greedy_equals_transformers_on_hand_quantised_weights():
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams
    from pagedllm.models.random_model import random_model_dir

    path = str(random_model_dir("random:tiny"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 40, 23, 70)]
    llm = LLM(path, quantization="int4", max_model_len=256, kv_cache_memory=2**20)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    del llm

    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for name, mod in hf.named_modules():
            if isinstance(mod, torch.nn.Linear):
                by_hand = _int8_lm_head_by_hand if name == "lm_head" else _int4_by_hand
                mod.weight.copy_(by_hand(mod.weight))
    assert_greedy_equal(outs, hf_greedy(hf, prompts, MAX_TOKENS), "int4")

    # the float checkpoint differs from its int4 rounding: the comparison above can tell them apart
    ref = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    float_tokens = [r[0] for r in hf_greedy(ref, prompts, MAX_TOKENS)]
    assert float_tokens != [o.outputs[0].token_ids for o in outs], "int4 rounding changed no token"
