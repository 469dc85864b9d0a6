"""The history gauges (``Observer.history_stats``) follow the removals, refreshed at most once a
second of batch time, however the batches reach the history (one by one or as a drained run)."""

from __future__ import annotations

from kvobs.observer import Observer
from tests.support.removals import record_removal


def _key(i: int) -> bytes:
    return bytes(32) + i.to_bytes(4, "big")


def test_history_stats_refresh_once_a_second_of_batch_time() -> None:
    observer = Observer()
    record_removal(observer, [_key(1)], "capacity", "store", "r", now=1000.0)
    assert observer.history_stats.keys == 1
    record_removal(observer, [_key(2)], "capacity", "store", "r", now=1000.4)  # within the second: not yet
    assert observer.history_stats.keys == 1
    record_removal(observer, [_key(3)], "capacity", "store", "r", now=1001.5)
    assert (observer.history_stats.keys, observer.history_stats.newest_time) == (3, 1001.5)
