"""`pagedllm proxy`: a KV-cache-aware front for prefill and decode instances (Mooncake's
conductor, vLLM's disaggregated proxy): predictor.py (TTFT / TBT from measured rates),
app.py (the OpenAI routes: prefill, then decode with the prefill's kv_transfer_params), cli.py."""
