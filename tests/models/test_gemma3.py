"""Gemma 3 270M, the real checkpoint (the gemma3-270m ready model, float32 weights dequantised
from its Q4_K_M GGUF): greedy output equals transformers' on the same directory, token for
token, with chunked prefill, preemption, and prompts longer than the sliding window (lowered
from 512 to 32 in a copy of config.json, for both engines, to keep the test cheap)."""

import json

import pytest
import torch
from greedy_utils import assert_greedy_equal, hf_greedy

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.model

WINDOW = 32
MAX_TOKENS = 16
TEXT = (
    "The lighthouse keeper woke before dawn, as he had every day for thirty years, and climbed "
    "the spiral stairs with a lantern in one hand and a mug of bitter coffee in the other. "
    "Outside, the sea was the colour of wet slate. Gulls argued on the rocks below. He checked "
    "the lamp, wiped the great lens with a soft cloth, and wrote the date in the logbook in small "
    "careful letters. In the town across the bay, the baker was already pulling loaves"
)


@pytest.fixture(scope="module")
def gemma3_small_window(tmp_path_factory):
    from pagedllm.models.download import GEMMA3_MODEL, ensure_ready_model

    src = ensure_ready_model(GEMMA3_MODEL, progress=False)
    out = tmp_path_factory.mktemp("gemma3-270m-window")
    for f in src.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["sliding_window"] == 512 and cfg["layer_types"].count("full_attention") == 3
    cfg.update(sliding_window=WINDOW, max_position_embeddings=1024)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_gemma3_270m_greedy_equals_transformers(gemma3_small_window):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gemma3_small_window)
    ids = tok(TEXT).input_ids
    assert ids[0] == tok.bos_token_id and len(ids) > 3 * WINDOW
    prompts = [ids[:20], ids[: WINDOW + 25], ids[: 3 * WINDOW + 1]]
    hf = AutoModelForCausalLM.from_pretrained(gemma3_small_window, dtype=torch.float32).eval()
    refs = hf_greedy(hf, prompts, MAX_TOKENS)
    del hf
    # Blocks of 8, 24 tokens a step. KV cache groups: 6 groups (1 global, 5 local) of 3 layers,
    # a block is 3 layers' pages; 55 blocks hold the longest request's worst case (97 + 16
    # tokens: 15 global blocks + 5 x 8 local ones), not the three requests together: preemption.
    llm = LLM(str(gemma3_small_window), block_size=8, max_num_batched_tokens=24, num_gpu_blocks=56)
    assert len(llm.llm_engine.core.scheduler.kv_cache_manager.managers) == 6
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
        use_tqdm=False,
    )
    assert_greedy_equal(outs, refs, "gemma3-270m, window 32", max_ties=1)
    assert llm.llm_engine.num_preemptions > 0
