"""Hook the CPU tier's cache policy so kvobs sees every removal, on any thread.

The protocol relied on (vLLM 0.33.0, notes §1): every chunk that leaves the CPU
tier leaves through the ``CachePolicy`` instance of the CPU-resident manager
(``CPUOffloadingManager._policy``):

* ``evict(n, protected) -> [(key, ChunkStatus)] | None``: capacity eviction in
  ``prepare_store`` (also reached from tiering promotions inside ``lookup()``,
  ``on_schedule_end()`` and the tier-poll thread, via ``prepare_write``);
* ``remove(key)``: a failed store (``complete_store(success=False)``);
* ``clear()``: ``reset_cache()``.

The hook sets instance attributes that call the original bound methods, so the
policy stays the same object of the same class, with the same state. Residency
(store -> removal) comes from stamping chunk slots in ``_allocate_chunks``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

monotonic = time.monotonic

RemovalCallback = Callable[[Sequence[bytes], str, Sequence[float] | None, float], None]
"""(keys, reason, residency seconds or None, monotonic time) -> None; must not raise."""

_HOOKED = "_kvobs_hooked"


def resident_chunks(policy: Any) -> list[tuple[bytes, Any]]:
    """(key, chunk) of every resident chunk, for the built-in LRU and ARC policies."""
    found: list[tuple[bytes, Any]] = []
    for name in ("chunks", "t1", "t2"):
        table = getattr(policy, name, None)
        if isinstance(table, Mapping):
            found.extend(table.items())
    return found


class PolicyHook:
    """Installed once on a CPU-tier manager; reports removals to ``on_removal``."""

    def __init__(self, cpu_manager: CPUOffloadingManager, on_removal: RemovalCallback) -> None:
        policy = cpu_manager._policy
        if getattr(policy, _HOOKED, False):
            raise ValueError("this manager's cache policy is already observed by kvobs")
        self.policy = policy
        self._on_removal = on_removal
        self._stamps: list[float] = [0.0] * max(0, int(cpu_manager._num_chunks))
        self._install(cpu_manager)

    def _install(self, manager: CPUOffloadingManager) -> None:
        policy = self.policy
        evict, remove, clear = policy.evict, policy.remove, policy.clear
        allocate = manager._allocate_chunks
        stamps = self._stamps
        report = self._on_removal

        def hooked_evict(n: int, protected: set[OffloadKey]) -> Any:
            evicted = evict(n, protected)
            if evicted:
                now = monotonic()
                try:
                    keys = [key for key, _ in evicted]
                    slots = [stamps[chunk.chunk_id] for _, chunk in evicted]
                    report(keys, "capacity", [now - stamp for stamp in slots if stamp], now)
                except Exception:
                    pass
            return evicted

        def hooked_remove(key: OffloadKey) -> None:
            chunk = policy.get(key)
            remove(key)
            now = time.monotonic()
            try:
                residency = _ages(now, stamps, (chunk,)) if chunk is not None else None
                report([key], "store_failed", residency, now)
            except Exception:
                pass

        def hooked_clear() -> None:
            try:
                resident = resident_chunks(policy)
            except Exception:
                resident = []
            clear()
            now = time.monotonic()
            try:
                keys = [key for key, _ in resident]
                residency = _ages(now, stamps, (chunk for _, chunk in resident))
                report(keys, "reset", residency, now)
            except Exception:
                pass

        def stamped_allocate(keys: list[OffloadKey]) -> Any:
            chunks = allocate(keys)
            now = monotonic()
            for chunk in chunks:
                stamps[chunk.chunk_id] = now
            return chunks

        # Instance attributes shadow the class's methods; the class is untouched.
        for name, hook in (("evict", hooked_evict), ("remove", hooked_remove), ("clear", hooked_clear)):
            setattr(policy, name, hook)
        setattr(policy, _HOOKED, True)
        if stamps:
            manager._allocate_chunks = stamped_allocate  # type: ignore[method-assign]


def _ages(now: float, stamps: list[float], chunks: Iterable[Any]) -> list[float]:
    """Seconds since each chunk's slot was allocated (unstamped slots are skipped)."""
    ages = []
    for chunk in chunks:
        stamp = stamps[chunk.chunk_id]
        if stamp:
            ages.append(now - stamp)
    return ages


def on_poll_thread() -> bool:
    """True on vLLM's tier-poll thread (removals there have no wrapper call above them)."""
    return threading.current_thread().name == "vllm_offload_tier_poll"
