"""Prefill and decode over the KV cache (one jitted program per call shape); per-token log-probs."""
