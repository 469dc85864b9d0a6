"""EvictionHistory: bounded, compact, and right about "when was this key last removed"."""

from __future__ import annotations

import os
import sys
import tracemalloc

import pytest

from kvobs.codes import PATHS, REASONS
from kvobs.history import EvictionHistory
from tests.support.columns import record_batch

CAPACITY = REASONS.index("capacity")
RESET = REASONS.index("reset")
STORE = PATHS.index("store")
LOOKUP = PATHS.index("lookup")


def keys(n: int) -> list[bytes]:
    return [os.urandom(32) + b"\x00\x00\x00\x01" for _ in range(n)]


def test_last_removal_names_time_reason_path_and_request() -> None:
    history = EvictionHistory(4096)
    batch = keys(3)
    serial = record_batch(history, batch, CAPACITY, LOOKUP, "req-b", now=100.0)
    (removal,) = history.last_removals([batch[1]])
    assert removal is not None
    assert (removal.serial, removal.time, removal.reason, removal.path, removal.req_id) == (
        serial, 100.0, "capacity", "lookup", "req-b",
    )


def test_unrecorded_key_has_no_removal() -> None:
    history = EvictionHistory(4096)
    record_batch(history, keys(10), CAPACITY, STORE, None, now=1.0)
    assert history.last_removals(keys(5)) == [None] * 5


def test_latest_removal_wins_and_serials_order_batches() -> None:
    history = EvictionHistory(4096)
    key = keys(1)
    first = record_batch(history, key, CAPACITY, STORE, "a", now=1.0)
    second = record_batch(history, key, RESET, PATHS.index("reset"), None, now=2.0)
    assert second == first + 1 == history.next_serial - 1
    (removal,) = history.last_removals(key)
    assert removal is not None and removal.serial == second and removal.reason == "reset"


def test_key_ring_forgets_the_oldest_keys_beyond_capacity() -> None:
    history = EvictionHistory(2048)
    old = keys(100)
    record_batch(history, old, CAPACITY, STORE, None, now=1.0)
    for i in range(40):  # 40 * 64 = 2560 newer keys push the old batch out
        record_batch(history, keys(64), CAPACITY, STORE, None, now=2.0 + i)
    assert history.last_removals(old[:10]) == [None] * 10
    stats = history.stats()
    assert stats.keys == 2048
    assert stats.oldest_time is not None and stats.oldest_time > 1.0


def test_batch_ring_overflow_ages_out_batch_details() -> None:
    history = EvictionHistory(1_000_000)  # 250,000 batch slots
    first = keys(1)
    record_batch(history, first, CAPACITY, STORE, "old", now=0.0)
    single = keys(1)[0]
    for i in range(history.batch_capacity):
        record_batch(history, [single], CAPACITY, STORE, None, now=1.0 + i * 1e-6)
    assert history.last_removals(first) == [None]
    stats = history.stats()
    assert stats.batches == history.batch_capacity
    assert stats.keys == history.batch_capacity  # keys whose batch details are still held


def test_window_spans_oldest_to_now() -> None:
    history = EvictionHistory(4096)
    record_batch(history, keys(2), CAPACITY, STORE, None, now=10.0)
    record_batch(history, keys(2), CAPACITY, STORE, None, now=25.0)
    stats = history.stats()
    assert stats.keys == 4 and stats.batches == 2
    assert stats.window(now=30.0) == pytest.approx(20.0)
    assert EvictionHistory(4096).stats().window(now=5.0) == 0.0


def test_serials_survive_32_bit_wraparound() -> None:
    history = EvictionHistory(4096)
    start = 2**32 - 3
    history._next_serial = history._batches_folded = start
    batch_keys = [keys(1) for _ in range(6)]
    for i, k in enumerate(batch_keys):
        record_batch(history, k, CAPACITY, STORE, f"r{i}", now=float(i))
    record_batch(history, batch_keys[0], CAPACITY, STORE, "again", now=9.0)
    first, last = history.last_removals([batch_keys[0][0], batch_keys[5][0]])
    assert first is not None and first.serial == start + 6 and first.req_id == "again"
    assert last is not None and last.serial == start + 5 and last.req_id == "r5"


def test_removal_at_gives_a_batch_by_serial_while_the_history_holds_it() -> None:
    history = EvictionHistory(4096)  # 1,024 batch slots
    first = record_batch(history, keys(1), RESET, PATHS.index("reset"), None, now=1.0)
    second = record_batch(history, [], RESET, PATHS.index("reset"), "r", now=3.0)
    found = history.removal_at(second)
    assert found is not None and (found.time, found.reason, found.path, found.req_id) == (3.0, "reset", "reset", "r")
    assert history.removal_at(history.next_serial) is None  # not yet recorded
    for i in range(1024):
        record_batch(history, keys(1), CAPACITY, STORE, None, now=4.0 + i)
    assert history.removal_at(first) is None  # its slot was reused
    assert history.removal_at(history.next_serial - 1) is not None


@pytest.mark.slow
def test_one_million_keys_fit_in_sixteen_mib() -> None:
    """Measured with tracemalloc, not taken from nbytes(): a history that kept key objects, a
    container per batch or a pending list alive would show here. Keys are made while tracing
    (so any the history retains are counted) and dropped by the caller, as vLLM does."""
    req_ids = [f"req-{i}" for i in range(64)]  # vLLM's strings, shared: made before tracing
    tracemalloc.start()
    try:
        history = EvictionHistory(1_000_000)
        written = batch = 0
        while written < 1_100_000:  # past the key ring's capacity
            batch_keys = [(written + i).to_bytes(32, "big") + b"\x00\x00\x00\x01" for i in range(16)]
            record_batch(history, batch_keys, CAPACITY, STORE, req_ids[batch % 64], now=float(batch))
            written += len(batch_keys)
            batch += 1
        stats = history.stats()  # folds what is pending
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert stats.keys == 1_000_000
    assert held <= 16 * 2**20 and peak <= 16 * 2**20, (held, peak)
    assert history.nbytes() <= held  # nbytes() does not overstate what is really held


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        EvictionHistory(0)


class _Model:
    """The history's contract in plain Python, over the same 32-bit fingerprints."""

    def __init__(self, capacity: int, batch_capacity: int) -> None:
        self.capacity, self.batch_capacity = capacity, batch_capacity
        self.entries: list[tuple[int, int]] = []  # (fingerprint, batch serial), oldest first
        self.batches: list[tuple[float, str | None]] = []

    def record(self, batch: list[bytes], now: float, req: str | None) -> None:
        serial = len(self.batches)
        self.batches.append((now, req))
        self.entries.extend((hash(k) & 0xFFFFFFFF, serial) for k in batch)
        del self.entries[: max(0, len(self.entries) - self.capacity)]

    def last(self, key: bytes) -> tuple[float, str | None] | None:
        fp = hash(key) & 0xFFFFFFFF
        serials = [s for f, s in self.entries if f == fp]
        live = max(0, len(self.batches) - self.batch_capacity)
        return self.batches[max(serials)] if serials and max(serials) >= live else None

    def keys_held(self) -> int:
        live = max(0, len(self.batches) - self.batch_capacity)
        return sum(1 for _, s in self.entries if s >= live)


@pytest.mark.parametrize("batch_sizes", [(1, 3), (1, 64)], ids=["batch-ring-wraps-first", "key-ring-wraps-first"])
def test_queries_and_stats_match_a_plain_model_past_both_rings(batch_sizes: tuple[int, int]) -> None:
    """Large enough for the one-pass candidate scan (>= 64 Ki keys) and the binary-searched stats."""
    import random

    rng = random.Random(3)
    history = EvictionHistory(70_000)
    model = _Model(history.capacity, history.batch_capacity)
    seen: list[bytes] = []
    for i in range(60_000 if batch_sizes == (1, 3) else 4_000):
        batch = [rng.randbytes(32) + b"\0\0\0\0" for _ in range(rng.randint(*batch_sizes))]
        if seen and rng.random() < 0.2:
            batch.append(rng.choice(seen))  # removed again: the latest removal wins
        seen.extend(batch[:1])
        record_batch(history, batch, CAPACITY, STORE, f"r{i % 7}", now=float(i))
        model.record(batch, float(i), f"r{i % 7}")
        if i % 9_973 == 0:
            assert history.stats().keys == model.keys_held()
    stats = history.stats()
    assert stats.keys == model.keys_held() and stats.batches == min(len(model.batches), history.batch_capacity)
    query = [*rng.sample(seen, 24), *(rng.randbytes(32) + b"\0\0\0\0" for _ in range(8))]
    for size in (len(query), 3, 1):  # the one-pass scan and the per-key scan agree with the model
        got = [None if r is None else (r.time, r.req_id) for r in history.last_removals(query[:size])]
        assert got == [model.last(k) for k in query[:size]]
    assert any(r is not None for r in history.last_removals(query))


def test_the_history_keeps_no_reference_to_the_request_ids_it_was_given() -> None:
    """Issue 43, item 4: a batch keeps its request as an ordinal into the history's own copies, so vLLM's
    request-id strings are not kept alive by it, and what the copies take is counted."""
    history = EvictionHistory(4096)
    req_id = "".join(["cmpl-", "f" * 40, "-0"])  # made at run time: no interned constant
    before = sys.getrefcount(req_id)
    batch = keys(2)
    record_batch(history, batch, CAPACITY, STORE, req_id, now=1.0)
    history.stats()  # folds what is pending
    assert sys.getrefcount(req_id) == before
    (removal,) = history.last_removals(batch[:1])
    assert removal is not None and removal.req_id == req_id and removal.req_id is not req_id
    empty = EvictionHistory(4096).nbytes()
    assert history.nbytes() >= empty + len(req_id)


def test_request_ids_beyond_the_remembered_are_forgotten_and_the_rest_kept() -> None:
    history = EvictionHistory(4096)  # 1,024 batch slots: as many ids remembered
    assert history.request_ids == 1024
    serials = [record_batch(history, keys(1), CAPACITY, STORE, f"req-{i}\udcff", now=float(i)) for i in range(1500)]
    oldest_kept = history.removal_at(serials[-1024])
    assert oldest_kept is not None and oldest_kept.req_id == f"req-{1500 - 1024}\udcff"  # a lone surrogate too
    assert history.removal_at(serials[0]) is None  # its batch slot was reused
    repeated = record_batch(history, keys(1), CAPACITY, STORE, "req-1499\udcff", now=2000.0)
    again = history.removal_at(repeated)
    assert again is not None and again.req_id == "req-1499\udcff"
    ids = EvictionHistory(2**20)
    assert ids.request_ids == 8_192
    for i in range(9_000):  # more distinct requests than remembered: the first ones' batches lose their id
        record_batch(ids, keys(1), CAPACITY, STORE, f"r{i}", now=float(i))
    first, last = ids.removal_at(0), ids.removal_at(8_999)
    assert first is not None and first.req_id is None and first.reason == "capacity"
    assert last is not None and last.req_id == "r8999"
    assert len(ids._ordinal_of_id) == 8_192
