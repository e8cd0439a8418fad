"""`bench kv-memory --per-request`: the bytes read from the meta-built models' specs equal the
arithmetic by hand (bfloat16, 2 bytes; 8 KV heads of 64, K and V)."""

import torch

from pagedllm.benchmarks.kv_memory_per_request import configs, meta_model, request_bytes


def test_bytes_per_request_equal_the_arithmetic():
    (hybrid, arch_h), (llama, arch_l) = configs().values()
    per_token_layer = 2 * 8 * 64 * 2  # K and V, 8 heads x 64, bf16
    lfm2 = meta_model(hybrid, arch_h, 4096)
    # 6 attention layers over 4096 tokens; 10 conv layers of a (2048, L_cache - 1 = 2) state.
    assert request_bytes(lfm2, 4096, 16, torch.bfloat16) == (6, 6 * 4096 * per_token_layer, 10, 10 * 2048 * 2 * 2)
    # 4001 tokens fill 251 blocks of 16: a partial block counts whole.
    assert request_bytes(lfm2, 4001, 16, torch.bfloat16)[1] == 6 * 4016 * per_token_layer
    assert request_bytes(meta_model(llama, arch_l, 4096), 4096, 16, torch.bfloat16) == (
        16,
        16 * 4096 * per_token_layer,
        0,
        0,
    )
