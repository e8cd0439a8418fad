"""The engine's core: block pool, KV cache manager and scheduler. No torch here."""
