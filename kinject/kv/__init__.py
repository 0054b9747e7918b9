"""kinject's KV cache: per-layer tiers, micro-batch views, streaming (sink + window)."""
