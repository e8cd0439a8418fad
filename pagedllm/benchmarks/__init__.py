"""`pagedllm bench ...`: benchmarks that print pagedllm beside a baseline, in one run."""
