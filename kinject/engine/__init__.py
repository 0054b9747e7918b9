"""The engine every operator and model family shares: tiered tensor store, transfer engine,
pipeline scheduler, correlation prefetcher, HQQ quantization."""
