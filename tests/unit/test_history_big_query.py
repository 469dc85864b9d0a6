"""``last_removals`` for the keys of a very long load stays fast and exact.

A failed load can ask for tens of thousands of keys (a 1M-token context in 16-token chunks is
62,500 keys in one KV group); the diagnosis queries them all on the failing scheduler thread.
The per-key scans were quadratic: 60,000 keys over a full 1M-key history took 14 s.
"""

from __future__ import annotations

import os
import time

from kvobs.history import EvictionHistory


def _filled(capacity: int, batch: int) -> tuple[EvictionHistory, list[bytes]]:
    history = EvictionHistory(capacity)
    keys = [os.urandom(36) for _ in range(capacity)]
    for start in range(0, capacity, batch):
        history.record(keys[start : start + batch], 0, 0, None, now=float(start))
    return history, keys


def test_a_long_load_is_diagnosed_in_bounded_time() -> None:
    history, keys = _filled(1_000_000, 64)
    wanted = keys[-60_000:]
    started = time.perf_counter()
    found = history.last_removals(wanted)
    elapsed = time.perf_counter() - started
    assert all(r is not None for r in found)
    assert elapsed < 3.0, f"{elapsed:.1f}s for 60,000 keys"


def test_big_queries_answer_as_small_ones() -> None:
    """Same answers whichever way a query is answered: repeats, never-removed and overwritten keys."""
    history, keys = _filled(50_000, 16)
    again = keys[10_000:12_000]
    history.record(again, 2, 4, "req-r", now=1e6)  # a second, later removal of these keys (a reset)
    never = [os.urandom(36) for _ in range(3_000)]
    wanted = keys[:5_000] + again + keys[-5_000:] + never
    whole = history.last_removals(wanted)
    pieces = [r for start in range(0, len(wanted), 3) for r in history.last_removals(wanted[start : start + 3])]
    assert whole == pieces
    assert all(r is not None and r.reason == "reset" and r.req_id == "req-r" for r in whole[5_000:7_000])
    assert sum(r is None for r in whole[:5_000]) >= 1_990  # the oldest keys were overwritten (fingerprints may collide)
    assert sum(r is None for r in whole[-3_000:]) >= 2_990  # never removed (32-bit fingerprints may collide)


def test_big_queries_answer_as_small_ones_when_batch_details_expired() -> None:
    history, keys = _filled(4_096, 1)  # 4,096 one-key batches; only the newest 1,024 keep their details
    whole = history.last_removals(keys)
    pieces = [r for start in range(0, len(keys), 3) for r in history.last_removals(keys[start : start + 3])]
    assert whole == pieces
    assert sum(r is None for r in whole) >= 3_060  # 3,072 expired (fingerprints may collide)
