"""Shared by the CPU kernel tests: a paged layout with shuffled physical blocks."""

import numpy as np


def shuffled_block_table(seq_lens: np.ndarray, block_size: int, rng) -> tuple[np.ndarray, int]:
    """Each request's blocks drawn at random from 1..N (block 0 stays the null block) ->
    (block_table [num_reqs, max_blocks] int32, number of cache slots)."""
    nb = -(-seq_lens // block_size)
    perm = rng.permutation(np.arange(1, nb.sum() + 1))
    table = np.zeros((len(seq_lens), nb.max()), dtype=np.int32)
    c = 0
    for i, n in enumerate(nb):
        table[i, :n] = perm[c : c + n]
        c += n
    return table, int((nb.sum() + 1) * block_size)


def paged_step(q_lens: np.ndarray, seq_lens: np.ndarray, block_size: int, rng):
    """A step of requests with q_lens new tokens each (seq_lens in all) in shuffled blocks ->
    (block_table, number of cache slots, query_start_loc [num_reqs + 1] int32, the new tokens'
    slot_mapping [sum(q_lens)] int64 tensor)."""
    import torch

    table, S = shuffled_block_table(seq_lens, block_size, rng)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    pos = np.concatenate([np.arange(s - q, s) for s, q in zip(seq_lens, q_lens)])
    req = np.repeat(np.arange(len(q_lens)), q_lens)
    slots = torch.from_numpy(table[req, pos // block_size].astype(np.int64) * block_size + pos % block_size)
    return table, S, qsl, slots


def check_rope_in_place(ops, make, cast, **close) -> None:
    """The fused RoPE rotates q and k in place, as the torch path would, and leaves v alone;
    make(rows, cols) draws a tensor, cast(module) sets the dtype; full and partial rotary."""
    import torch

    from pagedllm.models.layers.rotary_embedding import RotaryEmbedding

    for partial in (1.0, 0.5):
        rope = cast(RotaryEmbedding({"rope_theta": 10000.0, "partial_rotary_factor": partial}, 64, 512))
        qkv = make(7, (9 + 2 * 3) * 64)
        pos = torch.tensor([0, 5, 100, 511, 3, 2, 1])
        q, k, v = qkv.split([576, 192, 192], dim=-1)
        q, k = q.view(7, 9, 64), k.view(7, 3, 64)
        rope.ops = None
        q_ref, k_ref = (t.clone() for t in rope(pos, q, k))
        v_before = v.clone()
        rope.ops = ops
        q_new, k_new = rope(pos, q, k)
        torch.testing.assert_close(q_new.float(), q_ref.float(), **close)
        torch.testing.assert_close(k_new.float(), k_ref.float(), **close)
        assert torch.equal(v, v_before)  # in place on q and k only


def packed_linear(lin, small_ops, lm_head=False):
    """A linear layer computing with the CPU's oneDNN-packed method (its few-row kernel where
    small_ops is given; lm_head: as the LM head's), holding nn.Linear lin's weights, as after
    loading."""
    from pagedllm.models.layers.cpu_packed_linear import CPUPackedLinearMethod
    from pagedllm.models.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(
        lin.in_features, lin.out_features, lin.bias is not None, CPUPackedLinearMethod(small_ops, lm_head)
    ).to(lin.weight.dtype)
    layer.weight.weight_loader(layer.weight, lin.weight.detach())
    if lin.bias is not None:
        layer.bias.weight_loader(layer.bias, lin.bias.detach())
    layer.linear_method.process_weights_after_loading(layer)
    return layer


def require_built(ext):
    """ext (a built C++ kernel or extension), else this test's verdict on why it is None: a
    skip only where the machine has no C++ compiler (or the kernels are turned off), a failure
    naming the build error where it has one. The engine falls back to torch for users; a test
    must not pass on that fallback."""
    if ext is not None:
        return ext
    import os

    import pytest

    from pagedllm import envs
    from pagedllm.csrc import build

    if envs.PAGEDLLM_NO_CPU_KERNELS:  # as the engine reads it ("0" is off)
        pytest.skip("the C++ kernels are turned off here (PAGEDLLM_NO_CPU_KERNELS=1)")
    if build.cxx_compiler() is None:
        pytest.skip(f"no C++ compiler on this machine ({os.environ.get('CXX', 'c++')} is not on PATH)")
    why = "; ".join(f"{name}: {reason}" for name, reason in build.build_failures.items())
    pytest.fail(f"a C++ extension did not build though a compiler exists: {why or 'no reason recorded'}")


def decode_loop_off_reason():
    """Why the C++ decode loop cannot run here (a documented switch or absence), or None."""
    import os

    import torch

    from pagedllm import envs
    from pagedllm.csrc import build

    if not envs.PAGEDLLM_CPU_DECODE_LOOP:
        return "the C++ decode loop is turned off here (PAGEDLLM_CPU_DECODE_LOOP=0)"
    if not envs.PAGEDLLM_CPU_PACKED_LINEAR:
        return "the packed linears the decode loop calls are turned off (PAGEDLLM_CPU_PACKED_LINEAR=0)"
    if envs.PAGEDLLM_NO_CPU_KERNELS:
        return "the C++ kernels are turned off here (PAGEDLLM_NO_CPU_KERNELS=1)"
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN (the decode loop calls its packed linears)"
    if build.cxx_compiler() is None:
        return f"no C++ compiler on this machine ({os.environ.get('CXX', 'c++')} is not on PATH)"
    return None


def require_decode_loop(runner):
    """runner.decode_loop (the C++ loop over the layers of a CPU decode step) of a float Llama on
    the CPU backend, else this test's verdict: a skip for decode_loop_off_reason(), a failure
    otherwise (a regression that turns the loop off must not pass)."""
    import pytest

    if runner.decode_loop is not None:
        return runner.decode_loop
    reason = decode_loop_off_reason()
    if reason:
        pytest.skip(reason)
    from pagedllm.csrc import build

    why = "; ".join(f"{name}: {r}" for name, r in build.build_failures.items())
    pytest.fail(f"the C++ decode loop did not apply to this model: {why or 'no build failure recorded'}")


def run_aot_script(script: str) -> list:
    """Run a script that compiles Triton kernels for a GPU that is not here (kernels/triton_aot.py's
    mechanism) and prints one JSON list of variants on its last line, in a subprocess without
    TRITON_INTERPRET (interpreted kernels do not compile) -> that list."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    variants = json.loads(res.stdout.strip().splitlines()[-1])
    print("\n".join(map(str, variants)))
    return variants
