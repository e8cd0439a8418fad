"""`--against vllm`: the same requests through vLLM's CPU build, installed in a venv of its own."""
