"""KV cache commit / rollback / compaction."""

from specdec.cache.kv import KVCache, common_prefix_len

__all__ = ["KVCache", "common_prefix_len"]
