"""The decoder layers of a decode step in one C++ call, on the CPU.

Eager Python runs ~20 ops a layer (module calls, views, index ops, residual adds), each a trip
through Python and the dispatcher: ~3 ms a step for a 30-layer model, whatever the step's rows
(beside ~11 ms of weight streaming at batch 1). This loop runs the same kernels
the eager path calls at the step's row count (linear_small, or bf16_pair_linear for bfloat16 on
AVX512-BF16, up to the methods' small_rows and oneDNN's packed linear above, as
CPUPackedLinearMethod picks, or bf16_pair_linear above, as CPUBf16PairLinearMethod picks where
oneDNN has no bf16 kernels; rms_norm, rotary_embedding_, paged_decode,
silu_and_mul) in the same order on the same values, so its hidden states equal the eager path's
bit for bit (tests/models/test_cpu_decode_loop.py); only the Python between them is gone.

Built once at load time (`build_decode_loop`) for a model whole on one rank, on the CPU, with
the fused ops and packed linears with the row-streaming kernel (oneDNN's or the bf16 pair
layout's), or quantized linears
(quant_linear, csrc/quant_ops.cpp; float32) (their methods, chosen when the layers were built)
and the cpu attention backend; the ModelRunner calls it instead of the model
for steps that are all decode (`DecodeLoop.applies`), of any number of rows (below the
smallest of its linear methods' `eager_from_rows`: CPUPackedLinearMethod.LARGE_ROWS where its
float32 linears take F.linear from there), a speculative verification's k + 1 tokens of a
request included: the cpu backend's metadata makes each of them a decode query over its own
prefix (attention/backends/torch_sdpa/metadata.py `max_decode_query_len`). It reads the KV caches
from the model's Attention layers and the metadata from the forward context.
`PAGEDLLM_CPU_DECODE_LOOP=0` turns it off (to compare).
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedllm import envs
from pagedllm.attention.backends.cpu_attn import kernels as cpu_kernels
from pagedllm.attention.layer import attention_layers
from pagedllm.csrc.build import cpu_extension
from pagedllm.forward_context import get_forward_context
from pagedllm.models.layers.cpu_bf16_pair_linear import CPUBf16PairLinearMethod
from pagedllm.models.layers.cpu_packed_linear import CPUPackedLinearMethod
from pagedllm.models.layers.linear_method import base_method
from pagedllm.models.layers.quantization.base import QuantizedLinearMethod


def decode_loop_ext():
    """The extension holding the loop (csrc/decode_loop.cpp's decode_layers) beside the fused
    ops and the decode kernel it calls, or None."""
    return cpu_extension()


class DecodeLoop:
    """The model's weights, flattened once at load time, and the call."""

    def __init__(self, model, ext) -> None:
        empty = torch.empty(0, dtype=next(model.parameters()).dtype)
        # The float linears' kernels (build_decode_loop takes a model whose layers' linears share
        # one method and dtype): bf16_pair_linear up to small_rows (CPUPackedLinearMethod.pairs),
        # and above it (CPUBf16PairLinearMethod: bfloat16 without oneDNN's kernels).
        qkv = base_method(model.layers[0].self_attn.qkv_proj)
        self.small_pairs = getattr(qkv, "pairs", False)
        self.large_pairs = isinstance(qkv, CPUBf16PairLinearMethod)

        def lin(m):  # a float linear: small weight, bias, large weight; a quantized one: qweight, bias, scales, mins
            b = m.bias if m.bias is not None else empty
            if isinstance(base_method(m), QuantizedLinearMethod):
                return [m.qweight, b, m.scales, m.mins]
            small = m.pair_weight if self.small_pairs else m.weight
            if small is None:  # one copy (weight_copies.py): small_rows is 0, nothing reads it
                small = empty
            return [small, b, m.pair_weight if self.large_pairs else m.packed_weight]

        self.weights = []
        # A step of this many rows and more takes the eager path: a linear there runs a kernel the
        # loop does not call (LinearMethodBase.eager_from_rows; float32 F.linear without AVX-512).
        methods = [base_method(p) for p in model.modules() if hasattr(p, "linear_method")]
        self.large_rows = min((m.eager_from_rows for m in methods if m.eager_from_rows is not None), default=None)
        # The rows up to which the float linears take their few-row kernel: the layers' one method's.
        self.small_rows = getattr(qkv, "small_rows", CPUPackedLinearMethod.SMALL_ROWS)
        for layer in model.layers:
            a, m = layer.self_attn, layer.mlp
            self.weights += [
                layer.input_layernorm.weight,
                *lin(a.qkv_proj),
                *lin(a.o_proj),
                layer.post_attention_layernorm.weight,
                *lin(m.gate_up_proj),
                *lin(m.down_proj),
            ]
        a = model.layers[0].self_attn
        self.dims = (a.num_heads, a.num_kv_heads, a.head_dim)
        self.scale = a.scale
        self.eps = model.norm.eps
        self.final_norm = model.norm.weight
        self.rope = model.rope
        self.embed_tokens = model.embed_tokens
        self.attns = list(attention_layers(model).values())  # their caches are bound later
        self.ext = ext
        self.lora_mapping = getattr(model, "lora_mapping", None)  # set by --enable-lora

    def applies(self, meta, num_tokens: int) -> bool:
        """A step the loop computes exactly as the eager layers: all decode (a verification's
        k + 1 tokens of a request are k + 1 decode queries in the cpu backend's metadata), attention by pages,
        any number of rows below `large_rows` (its linears pick their kernel by rows as the eager ones), no LoRA adapter in the step
        (the loop has no adapter deltas; base-only steps still take it), and a float KV cache (the
        loop writes K/V unquantized: an int8 / fp8 cache, with its scales, takes the eager path)."""
        if self.lora_mapping is not None and self.lora_mapping.active:
            return False
        return (
            meta.all_decode
            and meta.decode_block_table is not None
            and num_tokens > 0
            and (self.large_rows is None or num_tokens < self.large_rows)
            and len(self.attns[0].kv_cache) == 2
        )

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [M] -> final hidden states [M, hidden], as the model's forward."""
        meta = get_forward_context().attn_metadata
        ks = [a.kv_cache[0] for a in self.attns]
        vs = [a.kv_cache[1] for a in self.attns]
        x = self.embed_tokens(input_ids)
        return self.ext.decode_layers(
            x,
            positions,
            self.weights,
            ks,
            vs,
            meta.slot_mapping,
            meta.decode_block_table,
            meta.decode_seq_lens,
            self.rope.cos,
            self.rope.sin,
            self.final_norm,
            *self.dims,
            meta.block_size,
            self.eps,
            self.scale,
            self.small_rows,
            self.small_pairs,
            self.large_pairs,
        )


def build_decode_loop(model, attn_backend) -> Optional[DecodeLoop]:
    """The DecodeLoop of a loaded CPU model where every piece it calls is in use, else None
    (decided once, at load time)."""
    from pagedllm.attention.backends.cpu_attn import CPUAttentionBackend
    from pagedllm.models.llama import LlamaForCausalLM

    if (
        not envs.PAGEDLLM_CPU_DECODE_LOOP
        or type(model) is not LlamaForCausalLM
        or not isinstance(attn_backend, CPUAttentionBackend)
    ):  # it calls that backend's kernel
        return None
    if model.shard.tp.tp_size > 1 or model.shard.pp_size > 1:  # the loop has no collectives
        return None
    if any(layer.self_attn.attn.sliding_window is not None for layer in model.stage_layers):
        return None  # the loop attends to every token (Mistral's sliding window: the backend)
    layer = model.layers[0]
    linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    if model.rope.ops is None or layer.mlp.act_fn.ops is None or model.norm.ops is None:
        return None
    methods = [base_method(m) for m in linears]
    quantized = [isinstance(lm, QuantizedLinearMethod) and lm.ops is not None for lm in methods]
    pairs = all(type(lm) is CPUBf16PairLinearMethod for lm in methods)  # bfloat16 without oneDNN's
    if all(quantized):  # quant_linear takes float32 activations (the only dtype quantization runs in)
        if model.norm.weight.dtype != torch.float32:
            return None
    elif not pairs and not all(isinstance(lm, CPUPackedLinearMethod) and lm.small_ops is not None for lm in methods):
        return None
    if model.rope.rot_dim != layer.self_attn.head_dim or not cpu_kernels.cpu_decode_supported(model.norm.weight.dtype):
        return None
    ext = decode_loop_ext()
    return DecodeLoop(model, ext) if ext is not None else None
