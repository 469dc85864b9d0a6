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

import sys
import time
from collections.abc import Mapping
from types import FrameType
from typing import Any

from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from kvobs.history import PATHS, REASONS
from kvobs.recorder import RecorderLike

monotonic = time.monotonic

_HOOKED = "_kvobs_hooked"
_STORE_FAILED = REASONS.index("store_failed")
_RESET = REASONS.index("reset")
_COMPLETE_STORE = PATHS.index("complete_store")
_CALLER_DEPTH = 4


def _failed_store_caller(frame: FrameType | None) -> tuple[int, str | None]:
    """(path, req_id) of the ``complete_store`` that removes a failed store, from its frame.

    vLLM 0.33.0 calls ``policy.remove`` only from ``CPUOffloadingManager.complete_store``
    (notes §1); kvobs forwards a CPU manager's ``complete_store`` untapped (it costs
    nothing on the hot path), so this rare removal finds its request on the stack.
    (-1, None) when there is no such caller: the recorder then uses its frame.
    """
    for _ in range(_CALLER_DEPTH):
        if frame is None:
            break
        if frame.f_code.co_name == "complete_store":
            req = frame.f_locals.get("req_context")
            return _COMPLETE_STORE, getattr(req, "req_id", None)
        frame = frame.f_back
    return -1, None


def resident_chunks(policy: Any) -> list[tuple[bytes, Any]]:
    """(key, chunk) of every resident chunk, for the built-in LRU and ARC policies."""
    found: list[tuple[bytes, Any]] = []
    for name in ("chunks", "t1", "t2"):
        table = getattr(policy, name, None)
        if isinstance(table, Mapping):
            found.extend(table.items())
    return found


class PolicyHook:
    """Installed once on a CPU-tier manager; queues every removal on ``recorder``.

    Capacity evictions (the hot case) and slot stamps go through the recorder's
    taps; failed stores and resets (rare) through the closures below.
    """

    def __init__(self, cpu_manager: CPUOffloadingManager, recorder: RecorderLike) -> None:
        policy = cpu_manager._policy
        if getattr(policy, _HOOKED, False):
            raise ValueError("this manager's cache policy is already observed by kvobs")
        self.policy = policy
        self.recorder = recorder
        self._install(cpu_manager)

    def _install(self, manager: CPUOffloadingManager) -> None:
        policy = self.policy
        recorder = self.recorder
        remove, clear = policy.remove, policy.clear

        def hooked_remove(key: OffloadKey) -> None:
            chunk = policy.get(key)
            remove(key)
            now = monotonic()
            try:
                residency = recorder.ages((chunk,), now) if chunk is not None and recorder.keep_batches else None
                path, req_id = _failed_store_caller(sys._getframe(1))
                recorder.removal([key], _STORE_FAILED, residency, now, path, req_id)
            except Exception:
                pass

        def hooked_clear() -> None:
            try:
                resident = resident_chunks(policy)
            except Exception:
                resident = []
            clear()
            now = monotonic()
            try:
                residency = recorder.ages((chunk for _, chunk in resident), now)
                recorder.removal([key for key, _ in resident], _RESET, residency, now)
            except Exception:
                pass

        # Instance attributes shadow the class's methods; the class is untouched.
        for name, hook in (("evict", recorder.evict_tap(policy.evict)), ("remove", hooked_remove),
                           ("clear", hooked_clear)):
            setattr(policy, name, hook)
        setattr(policy, _HOOKED, True)
        if int(manager._num_chunks) > 0:
            manager._allocate_chunks = recorder.allocate_tap(manager._allocate_chunks)  # type: ignore[method-assign]

