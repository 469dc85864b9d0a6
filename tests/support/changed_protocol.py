"""An out-of-tree cache policy kvobs does not know (for test_fail_open).

vLLM loads it through its own mechanism (``eviction_policy`` + ``cache_policy_module_path``, every
supported release). It keeps its chunks inside a wrapped LRU policy instead of in a ``chunks``
table, so kvobs cannot list them at a reset: kvobs must step aside and vLLM run as without it.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.cpu.policies.base import CachePolicy
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy


class WrappedLRUPolicy(CachePolicy):
    """vLLM's LRU policy, behind another object (what a custom policy could well look like)."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._lru = LRUCachePolicy(cache_capacity=cache_capacity)

    def get(self, *args: Any, **kwargs: Any) -> Any:
        return self._lru.get(*args, **kwargs)

    def insert(self, *args: Any, **kwargs: Any) -> Any:
        return self._lru.insert(*args, **kwargs)

    def remove(self, *args: Any, **kwargs: Any) -> Any:
        return self._lru.remove(*args, **kwargs)

    def touch(self, *args: Any, **kwargs: Any) -> Any:
        return self._lru.touch(*args, **kwargs)

    def evict(self, *args: Any, **kwargs: Any) -> Any:
        return self._lru.evict(*args, **kwargs)

    def clear(self, *args: Any, **kwargs: Any) -> Any:
        return self._lru.clear(*args, **kwargs)

    def mark_evictable(self, *args: Any, **kwargs: Any) -> Any:
        return self._lru.mark_evictable(*args, **kwargs)

    def mark_non_evictable(self, *args: Any, **kwargs: Any) -> Any:
        return self._lru.mark_non_evictable(*args, **kwargs)

    # Hooks later releases added (0.31: on_store_miss, on_request_finished; 0.33: on_request_access).
    def on_store_miss(self, *args: Any, **kwargs: Any) -> Any:
        return self._lru.on_store_miss(*args, **kwargs)

    def on_request_access(self, *args: Any, **kwargs: Any) -> Any:
        return self._lru.on_request_access(*args, **kwargs)

    def on_request_finished(self, *args: Any, **kwargs: Any) -> Any:
        return self._lru.on_request_finished(*args, **kwargs)
