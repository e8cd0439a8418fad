"""Weight-only quantization on the CPU: one LinearMethod per format (vLLM's
model_executor/layers/quantization/).

- int8 (int8.py): int8 with a scale and an offset (256 codes over the range, held as mins) in groups of 32
  (default) / 64 / 128 input features, or per output channel (group size -1), made at load time.
- int4 (int4.py): groups of 32/64/128 input features, each with a scale and a min (w = q s + m,
  q in 0..15), made at load time.
- gguf (gguf.py): a GGUF file's Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K tensors
  held in their own blocks, 16 rows interleaved (gguf_method.py, gguf_repack.py).
- fp8 (fp8.py): a checkpoint stored in FP8 blocks (config.json quantization_config), upcast at load.

registry.py names them (name -> config class; the CLI, the benches, config validation and the
loader read it). The loader makes the model's config current while it builds the model
(`set_current_quant_config`); linear.py `default_linear_method` asks it for each layer's method.
The kernels are csrc/quant_ops.cpp and csrc/gguf_linear.cpp (float32 activations).
"""

from __future__ import annotations

import contextlib

_current = None


@contextlib.contextmanager
def set_current_quant_config(config):
    """Layers built inside take their LinearMethod from `config` (None: unquantized)."""
    global _current
    old, _current = _current, config
    try:
        yield
    finally:
        _current = old


def current_quant_config():
    return _current
