"""``last_removals`` for the keys of a very long load stays fast and exact.

A failed load can ask for tens of thousands of keys (a 1M-token context in 16-token chunks is
62,500 keys in one KV group); the diagnosis queries them all on the failing scheduler thread.
The per-key scans were quadratic: 60,000 keys over a full 1M-key history took 14 s.
"""

from __future__ import annotations

import os
import random
import time

from kvobs.history import EvictionHistory
from tests.support.columns import record_batch


def _filled(capacity: int, batch: int) -> tuple[EvictionHistory, list[bytes]]:
    history = EvictionHistory(capacity)
    keys = [os.urandom(36) for _ in range(capacity)]
    for start in range(0, capacity, batch):
        record_batch(history, keys[start : start + batch], 0, 0, None, now=float(start))
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
    record_batch(history, again, 2, 4, "req-r", now=1e6)  # a second, later removal of these keys (a reset)
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


def test_first_removals_big_queries_answer_as_small_ones() -> None:
    """The first removal at or after a serial, by sorted join (many keys) and by scans (few): the
    same answers, fingerprints above 2**31 included (their high bit once broke the join's ordering)."""
    history = EvictionHistory(40_000)
    keys = [os.urandom(36) for _ in range(20_000)]
    for start in range(0, len(keys), 4):  # 5,000 batches of 4 keys: key i in batch i // 4
        record_batch(history, keys[start : start + 4], 0, 0, None, now=float(start))
    again = keys[1_000:3_000]
    record_batch(history, again, 1, 3, "req-f", now=1e6)  # a later removal of these keys
    rng = random.Random(3)
    wanted = keys[:6_000] + [os.urandom(36) for _ in range(500)]
    since = [rng.randrange(0, history.next_serial + 1) for _ in wanted]
    whole = history.first_removals(wanted, since)
    pieces = [r for start in range(0, len(wanted), 3)
              for r in history.first_removals(wanted[start : start + 3], since[start : start + 3])]
    assert whole == pieces
    for removal, after in zip(whole, since, strict=True):
        assert removal is None or removal.serial >= after
    for i in range(1_000, 3_000):  # removed twice: the first removal at or after the serial asked for
        if since[i] > 5_000:
            assert whole[i] is None
            continue
        want = ("capacity", i // 4) if since[i] <= i // 4 else ("store_failed", 5_000)
        assert whole[i] is not None and (whole[i].reason, whole[i].serial) == want
