"""Long-context inference on the sequence mesh: a sharded prefill, and decode over a KV cache that stays sharded."""

from .cache import ShardedKVCache, cache_bytes
from .generate import Generated, Sampling, generate, shard_weights, split_heads

__all__ = ["Generated", "Sampling", "ShardedKVCache", "cache_bytes", "generate", "shard_weights", "split_heads"]
