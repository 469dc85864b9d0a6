"""Bounded, compact history of chunk removals from the CPU tier.

Why this layout: a removal history must reach back minutes to hours under heavy
eviction, so it cannot keep one Python object per key (an ``OrderedDict`` of
key -> time costs ~150 bytes a key). Here a key costs 8 bytes:

* a key ring of ``capacity`` slots holding a 32-bit fingerprint of the key and
  the 32-bit serial of the batch that removed it (numpy ``uint32`` arrays);
* a batch ring (``capacity // 4`` slots, at least 1024) holding, per removal
  batch, its monotonic time, reason, path and the request that caused it.

Recording is O(1) per batch on the caller's thread: a batch is appended to a
pending list and folded into the rings in vectorised steps once a few thousand
keys are pending, or when somebody asks a question. Batch serials double as the
sequence number that orders removals against lookups: a lookup remembers
``next_serial``; a removal with a serial at or above it came after the lookup.

Fingerprints are 32 bits: a query for a key that was never removed matches some
other key with probability ``len(history) / 2**32`` (2.3e-4 at 1M keys); the
diagnosis only trusts matches after the request's lookup, where the window is
small. Documented in docs/design.md.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

REASONS: tuple[str, ...] = ("capacity", "store_failed", "reset")
"""Why chunks left the CPU tier (the ``reason`` label)."""

PATHS: tuple[str, ...] = (
    "store",
    "lookup",
    "schedule_end",
    "complete_store",
    "reset",
    "poll_thread",
    "unobserved",
)
"""Which manager entry point was running when the removal happened."""

_MIN_BATCHES = 1024
_RESET = REASONS.index("reset")
KEEP_RESETS = 64
"""Resets are rare and a reset batch may list no keys, so they are also kept on the side."""
_FLUSH_AT_KEYS = 4096
_PREFILTER_KEYS = 4  # queries of at least this many keys over a ring of at least
_PREFILTER_RING = 65_536  # this many keys scan the ring once (see last_removals)
_SORT_JOIN_KEYS = 4_096  # queries of at least this many keys sort the ring once (see last_removals)


@dataclass(frozen=True, slots=True)
class Removal:
    """The last recorded removal of one key."""

    serial: int
    time: float
    reason: str
    path: str
    req_id: str | None


class HistoryStats(NamedTuple):
    """Size and reach of the history, for gauges and the message."""

    keys: int
    batches: int
    oldest_time: float | None
    newest_time: float | None

    def window(self, now: float) -> float:
        """Seconds the history reaches back from ``now`` (0.0 when empty)."""
        return 0.0 if self.oldest_time is None else max(0.0, now - self.oldest_time)


def fingerprints(keys: Iterable[bytes], count: int) -> np.ndarray:
    """32-bit fingerprints of ``keys`` (Python's bytes hash, cached per object)."""
    return np.fromiter(map(hash, keys), dtype=np.int64, count=count).astype(np.uint32)


class EvictionHistory:
    """Record removal batches; answer "when was each of these keys last removed"."""

    def __init__(self, capacity: int = 1_000_000) -> None:
        if capacity < 1:
            raise ValueError(f"history capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.batch_capacity = max(_MIN_BATCHES, capacity // 4)
        self._key_fp = np.zeros(capacity, dtype=np.uint32)
        self._key_serial = np.zeros(capacity, dtype=np.uint32)
        self._keys_written = 0
        self._batch_time = np.zeros(self.batch_capacity, dtype=np.float64)
        self._batch_flags = np.zeros(self.batch_capacity, dtype=np.uint8)
        self._batch_req: list[str | None] = [None] * self.batch_capacity
        self._batches_folded = 0
        self._next_serial = 0
        # Pending batches as flat lists of plain values (key hashes, not keys): recording
        # creates no container that outlives the call, so it adds no work for the GC.
        self._p_hashes: list[int] = []
        self._p_counts: list[int] = []
        self._p_times: list[float] = []
        self._p_flags: list[int] = []
        self._p_reqs: list[str | None] = []
        # Runs of batches handed over column by column (record_columns), as arrays, in order;
        # the lists above hold what record() added after them.
        self._p_sealed: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[str | None]]] = []
        self._p_sealed_keys = 0
        self._resets: deque[Removal] = deque(maxlen=KEEP_RESETS)

    @property
    def next_serial(self) -> int:
        """Serial the next batch will get; lookups remember it."""
        return self._next_serial

    def record(
        self,
        keys: Sequence[bytes],
        reason: int,
        path: int,
        req_id: str | None,
        now: float | None = None,
    ) -> int:
        """Record one removal batch (an empty batch marks e.g. a reset); return its serial."""
        serial = self._next_serial
        self._next_serial = serial + 1
        now = time.monotonic() if now is None else now
        hashes = self._p_hashes
        hashes.extend(map(hash, keys))
        self._p_counts.append(len(keys))
        self._p_times.append(now)
        self._p_flags.append(reason | (path << 2))
        self._p_reqs.append(req_id)
        if reason == _RESET:
            self._resets.append(Removal(serial, now, REASONS[reason], PATHS[path], req_id))
        if len(hashes) + self._p_sealed_keys >= _FLUSH_AT_KEYS:
            self._fold()
        return serial

    def record_columns(
        self,
        first_serial: int,
        hashes: bytes,
        counts: bytes,
        times: bytes,
        flags: bytes,
        reqs: list[str | None],
        resets: int = 0,
    ) -> None:
        """Record a run of batches given column by column, as :meth:`record` would one by one.

        ``hashes`` are ``hash(key)`` of every key and ``counts`` the keys per batch (native
        int64), ``times`` monotonic seconds (float64), ``flags`` ``reason | path << 2`` (int64);
        the first batch must get ``first_serial``; ``resets`` says how many are resets.
        """
        if not counts:  # an empty run (its first_serial means nothing)
            return
        if first_serial != self._next_serial:
            raise ValueError(f"batch serial {first_serial} where the history expects {self._next_serial}")
        key_hashes = np.frombuffer(hashes, dtype=np.int64)
        batch_counts = np.frombuffer(counts, dtype=np.int64)
        batch_times = np.frombuffer(times, dtype=np.float64)
        batch_flags = np.frombuffer(flags, dtype=np.int64)
        n = len(batch_counts)
        if not (n == len(batch_times) == len(batch_flags) == len(reqs)) or int(batch_counts.sum()) != len(key_hashes):
            raise ValueError("removal columns of different lengths")
        self._seal_open()
        self._p_sealed.append((key_hashes, batch_counts, batch_times, batch_flags, reqs))
        self._p_sealed_keys += len(key_hashes)
        self._next_serial = first_serial + n
        if resets:
            for i in np.flatnonzero((batch_flags & 3) == _RESET).tolist():
                self._resets.append(Removal(
                    first_serial + i, float(batch_times[i]), REASONS[_RESET], PATHS[int(batch_flags[i]) >> 2], reqs[i]
                ))
        if self._p_sealed_keys + len(self._p_hashes) >= _FLUSH_AT_KEYS:
            self._fold()

    def _seal_open(self) -> None:
        """Turn what record() added into a sealed run (keeps batch order when both are used)."""
        if not self._p_counts:
            return
        self._p_sealed.append((
            np.array(self._p_hashes, dtype=np.int64),
            np.array(self._p_counts, dtype=np.int64),
            np.array(self._p_times, dtype=np.float64),
            np.array(self._p_flags, dtype=np.int64),
            self._p_reqs,
        ))
        self._p_sealed_keys += len(self._p_hashes)
        self._p_hashes, self._p_counts, self._p_times, self._p_flags, self._p_reqs = [], [], [], [], []

    def _fold(self) -> None:
        """Move pending batches into the rings with a few vectorised writes."""
        if not self._p_counts and not self._p_sealed:
            return
        self._seal_open()
        parts, self._p_sealed, self._p_sealed_keys = self._p_sealed, [], 0
        if len(parts) == 1:
            hashes, counts, times, flags, reqs = parts[0]
        else:
            hashes = np.concatenate([p[0] for p in parts])
            counts = np.concatenate([p[1] for p in parts])
            times = np.concatenate([p[2] for p in parts])
            flags = np.concatenate([p[3] for p in parts])
            reqs = [req for p in parts for req in p[4]]
        n = len(counts)
        first_serial = self._batches_folded
        bcap = self.batch_capacity
        start = first_serial % bcap
        if n > bcap:  # only the newest bcap batches keep their details
            skip = n - bcap
            times, flags, reqs = times[skip:], flags[skip:], reqs[skip:]
            start = (first_serial + skip) % bcap
        kept = len(times)
        head = min(kept, bcap - start)
        self._batch_time[start : start + head] = times[:head]
        self._batch_flags[start : start + head] = flags[:head]
        self._batch_req[start : start + head] = reqs[:head]
        if head < kept:
            self._batch_time[: kept - head] = times[head:]
            self._batch_flags[: kept - head] = flags[head:]
            self._batch_req[: kept - head] = reqs[head:]
        self._batches_folded += n

        total = len(hashes)
        if total:
            fps = hashes.astype(np.uint32)
            serials = np.arange(first_serial, first_serial + n, dtype=np.int64).astype(np.uint32)
            key_serials = np.repeat(serials, counts)
            if total > self.capacity:
                fps = fps[-self.capacity :]
                key_serials = key_serials[-self.capacity :]
                self._keys_written += total - self.capacity
                total = self.capacity
            start = self._keys_written % self.capacity
            head = min(total, self.capacity - start)
            self._key_fp[start : start + head] = fps[:head]
            self._key_serial[start : start + head] = key_serials[:head]
            if head < total:
                self._key_fp[: total - head] = fps[head:]
                self._key_serial[: total - head] = key_serials[head:]
            self._keys_written += total

    def _oldest_live_serial(self) -> int:
        return max(0, self._batches_folded - self.batch_capacity)

    def _full_serials(self, stored: np.ndarray) -> np.ndarray:
        """Undo the 32-bit wrap of stored serials (all lie within 2**32 of now)."""
        newest = np.uint32(self._batches_folded & 0xFFFFFFFF)
        behind = (newest - stored).astype(np.int64)  # uint32 arithmetic wraps
        return self._batches_folded - behind

    def _removal(self, serial: int) -> Removal:
        slot = serial % self.batch_capacity
        flags = int(self._batch_flags[slot])
        return Removal(
            serial=serial,
            time=float(self._batch_time[slot]),
            reason=REASONS[flags & 0b11],
            path=PATHS[flags >> 2],
            req_id=self._batch_req[slot],
        )

    def last_removals(self, keys: Sequence[bytes]) -> list[Removal | None]:
        """The most recent removal of each key, or None where none is recorded."""
        self._fold()
        filled = min(self._keys_written, self.capacity)
        ring = self._key_fp[:filled]
        oldest_live = self._oldest_live_serial()
        wanted = fingerprints(keys, len(keys))
        if len(keys) >= _SORT_JOIN_KEYS and filled:
            return self._last_removals_sorted(ring, wanted, oldest_live)
        positions: np.ndarray | None = None
        if len(keys) >= _PREFILTER_KEYS and filled >= _PREFILTER_RING:
            # One pass over the ring instead of one per key: a 64 Ki-entry table
            # of the wanted fingerprints' low 16 bits picks the few candidates.
            table = np.zeros(1 << 16, dtype=bool)
            table[wanted & 0xFFFF] = True
            positions = np.flatnonzero(np.take(table, ring & 0xFFFF))
            ring = ring[positions]
        out: list[Removal | None] = []
        for fp in wanted.tolist():
            where = np.flatnonzero(ring == fp)
            if positions is not None:
                where = positions[where]
            if where.size == 0:
                out.append(None)
                continue
            serial = int(self._full_serials(self._key_serial[where]).max())
            out.append(self._removal(serial) if serial >= oldest_live else None)
        return out

    def _last_removals_sorted(
        self, ring: np.ndarray, wanted: np.ndarray, oldest_live: int
    ) -> list[Removal | None]:
        """``last_removals`` for many keys: O((n + m) log n), not one ring scan per key.

        The keys of a long load (tens of thousands) made the per-key scans quadratic: 60,000
        keys over a full 1M-key ring took 14 s on the failing scheduler thread.
        """
        serials = self._full_serials(self._key_serial[: len(ring)])
        order = np.lexsort((serials, ring))  # by fingerprint, then serial: a run's last is its newest
        sorted_fps, sorted_serials = ring[order], serials[order]
        last = np.searchsorted(sorted_fps, wanted, side="right") - 1
        safe = np.maximum(last, 0)
        hit = (last >= 0) & (sorted_fps[safe] == wanted)
        return [
            self._removal(serial) if found and serial >= oldest_live else None
            for found, serial in zip(hit.tolist(), sorted_serials[safe].tolist(), strict=True)
        ]

    def reset_since(self, serial: int) -> Removal | None:
        """The first reset with a serial >= ``serial`` among the last ``KEEP_RESETS`` resets."""
        return next((reset for reset in self._resets if reset.serial >= serial), None)

    def stats(self) -> HistoryStats:
        """How many keys and batches are held, and the time span they cover.

        O(log n): it runs on the scheduler thread (at most once a second), so it
        binary-searches the key ring instead of copying it.
        """
        self._fold()
        if self._batches_folded == 0:
            return HistoryStats(0, 0, None, None)
        oldest_live = self._oldest_live_serial()
        filled = min(self._keys_written, self.capacity)
        keys = filled
        oldest_serial = oldest_live
        if filled:
            oldest_key_serial = self._key_serial_at(0)
            if oldest_key_serial < oldest_live:
                keys = filled - self._first_key_from(oldest_live)
            else:
                oldest_serial = oldest_key_serial
        newest = self._batches_folded - 1
        return HistoryStats(
            keys=keys,
            batches=self._batches_folded - oldest_live,
            oldest_time=float(self._batch_time[oldest_serial % self.batch_capacity]),
            newest_time=float(self._batch_time[newest % self.batch_capacity]),
        )

    def _key_serial_at(self, index: int) -> int:
        """Full batch serial of the ``index``-th oldest key held."""
        filled = min(self._keys_written, self.capacity)
        start = self._keys_written % self.capacity if filled == self.capacity else 0
        stored = int(self._key_serial[(start + index) % self.capacity])
        return self._batches_folded - ((self._batches_folded - stored) & 0xFFFFFFFF)

    def _first_key_from(self, serial: int) -> int:
        """Index (oldest first) of the first key whose batch serial is >= ``serial``.

        Key serials rise along the ring, oldest to newest, so a binary search finds it.
        """
        low, high = 0, min(self._keys_written, self.capacity)
        while low < high:
            mid = (low + high) // 2
            if self._key_serial_at(mid) < serial:
                low = mid + 1
            else:
                high = mid
        return low

    def nbytes(self) -> int:
        """Bytes held by the rings (the request-id strings are shared, not counted)."""
        return (
            self._key_fp.nbytes
            + self._key_serial.nbytes
            + self._batch_time.nbytes
            + self._batch_flags.nbytes
            + 8 * len(self._batch_req)
        )
