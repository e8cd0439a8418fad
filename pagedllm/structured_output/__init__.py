"""Structured output (vLLM v1's shape): grammars compiled once per distinct spec off the engine
loop (manager.py), one matcher per request (request.py), one token bitmask per constrained row
each step, applied to the logits by the sampler (worker/sampler.py)."""
