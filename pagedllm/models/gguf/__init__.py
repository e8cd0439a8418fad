"""GGUF files read with the `gguf` package, architecture by architecture (no transformers GGUF
reader: the metadata of a file is read in seconds, its weights are never dequantised whole).

- metadata.py: the file's key-value metadata as plain Python values.
- hf_config.py: `{arch}.*` metadata -> the HF config.json of the registered architecture.
- tokenizer.py: `tokenizer.ggml.*` metadata -> tokenizer.json / tokenizer_config.json.
- tensor_names.py: llama.cpp tensor names -> HF checkpoint names, per architecture, and what
  llama.cpp's converter did to a tensor that must be undone (Q/K rows, Gemma's norm + 1).
- weights.py: the file's tensors as (HF name, tensor) for the loader, quantized linears
  repacked by the caller's function, everything else dequantised.
- model_dir.py: the small model directory (config, tokenizer, gguf.json) that serves a file.
- tp_split.py: tensor parallelism over the blocks (which bytes of a row a rank holds).
- writer.py: random-weight GGUF files of real shapes, as llama.cpp's converter writes them.
"""
