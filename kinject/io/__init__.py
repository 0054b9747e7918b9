"""Checkpoints: safetensors index from headers, streaming load straight into the tiers."""
