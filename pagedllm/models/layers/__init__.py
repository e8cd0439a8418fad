"""The building blocks of a model, shared by every architecture (vLLM's model_executor/layers):
linear layers that hold one tensor-parallel rank's slice and load it themselves (linear.py), how
a linear layer computes (linear_method.py, cpu_packed_linear.py), the vocabulary-parallel
embedding and LM head, RMSNorm, RoPE and SiLU-and-mul."""
