"""Bounded, compact history of chunk removals from the CPU tier.

Why this layout: a removal history must reach back minutes to hours under heavy
eviction, so it cannot keep one Python object per key (an ``OrderedDict`` of
key -> time costs ~150 bytes a key). Here a key costs 8 bytes:

* a key ring of ``capacity`` slots holding a 32-bit fingerprint of the key and
  the 32-bit serial of the batch that removed it (numpy ``uint32`` arrays);
* a batch ring (``capacity // 4`` slots, at least 1024) holding, per removal
  batch, its monotonic time, reason, path and the request that caused it, as the 32-bit ordinal of
  its id in a ring of the last ``REQUEST_IDS`` distinct request ids (their UTF-8 bytes, copies): the
  history keeps no reference to vLLM's objects, and what the ids take is bounded and counted in
  :meth:`EvictionHistory.nbytes`. A batch whose request fell out of that ring keeps its time, reason and
  path and loses its request id (issue 43, item 4).

Recording takes whole runs of batches, column by column, as the recorder queued them
(``kvobs.hot_path_loader.RemovalRun``), and folds them into the rings in vectorised steps once
a few thousand keys are pending, or when somebody asks a question. Batch serials are the
recorder's: a promise names the serial of the removal that broke it, and
:meth:`EvictionHistory.removal_at` gives that batch's details.

Storage sits behind four questions (record a run, last removal of keys, a batch by serial,
size and reach): the layout can change without touching the observer or the diagnosis.

Fingerprints are 32 bits: a query for a key that was never removed matches some
other key with probability ``len(history) / 2**32`` (2.3e-4 at 1M keys); it
only affects the "seconds since eviction" of keys that were never removed. Documented in
docs/design.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from kvobs.codes import PATHS, REASONS, unpack_flags

_MIN_BATCHES = 1024
REQUEST_IDS = 8_192
"""Distinct request ids the history remembers (at most; fewer with fewer batch slots)."""
_ID_BYTES_OVERHEAD = 33 + 8 + 100
"""Estimated bytes one remembered id costs beyond its UTF-8 length: the bytes object's header, its ring
slot and its entry in the index (a dict entry and its share of the table)."""
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

    def __init__(self, capacity: int) -> None:  # no default of its own: the history_size option's (kvobs.options)
        if capacity < 1:
            raise ValueError(f"history capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.batch_capacity = max(_MIN_BATCHES, capacity // 4)
        self._key_fp = np.zeros(capacity, dtype=np.uint32)
        self._key_serial = np.zeros(capacity, dtype=np.uint32)
        self._keys_written = 0
        self._batch_time = np.zeros(self.batch_capacity, dtype=np.float64)
        self._batch_flags = np.zeros(self.batch_capacity, dtype=np.uint8)
        self._batch_req = np.zeros(self.batch_capacity, dtype=np.uint32)  # request ordinals, 0: none
        self.request_ids = min(REQUEST_IDS, self.batch_capacity)
        self._id_of_ordinal: list[bytes | None] = [None] * self.request_ids  # slot: ordinal % request_ids
        self._ordinal_of_id: dict[bytes, int] = {}
        self._next_ordinal = 1
        self._id_bytes = 0
        self._batches_folded = 0
        self._next_serial = 0
        # Runs handed over by record_columns, folded into the rings in vectorised steps.
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self._pending_keys = 0

    @property
    def next_serial(self) -> int:
        """The serial the next recorded batch must have."""
        return self._next_serial

    def record_columns(
        self,
        first_serial: int,
        hashes: Any,
        counts: Any,
        times: Any,
        flags: Any,
        reqs: Sequence[str | None],
    ) -> None:
        """Record a run of removal batches given column by column (``kvobs.hot_path_loader.RemovalRun``).

        ``hashes`` are ``hash(key)`` of every key and ``counts`` the keys per batch (native
        int64), ``times`` monotonic seconds (float64), ``flags`` ``kvobs.codes.pack_flags``
        (uint8); the first batch must get ``first_serial``. The columns are copied.
        """
        key_hashes = np.frombuffer(hashes, dtype=np.int64)
        batch_counts = np.frombuffer(counts, dtype=np.int64)
        batch_times = np.frombuffer(times, dtype=np.float64)
        batch_flags = np.frombuffer(flags, dtype=np.uint8)
        n = len(batch_counts)
        if n == 0:
            return
        if first_serial != self._next_serial:
            raise ValueError(f"batch serial {first_serial} where the history expects {self._next_serial}")
        if not (n == len(batch_times) == len(batch_flags) == len(reqs)) or int(batch_counts.sum()) != len(key_hashes):
            raise ValueError("removal columns of different lengths")
        ordinals = np.fromiter(map(self._ordinal, reqs), dtype=np.uint32, count=n)
        self._pending.append((key_hashes.copy(), batch_counts.copy(), batch_times.copy(), batch_flags.copy(), ordinals))
        self._pending_keys += len(key_hashes)
        self._next_serial = first_serial + n
        if self._pending_keys >= _FLUSH_AT_KEYS:
            self._fold()

    def _fold(self) -> None:
        """Move pending runs into the rings with a few vectorised writes."""
        if not self._pending:
            return
        parts, self._pending, self._pending_keys = self._pending, [], 0
        if len(parts) == 1:
            hashes, counts, times, flags, reqs = parts[0]
        else:
            hashes = np.concatenate([p[0] for p in parts])
            counts = np.concatenate([p[1] for p in parts])
            times = np.concatenate([p[2] for p in parts])
            flags = np.concatenate([p[3] for p in parts])
            reqs = np.concatenate([p[4] for p in parts])
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
        reason, path = unpack_flags(int(self._batch_flags[slot]))
        return Removal(
            serial=serial,
            time=float(self._batch_time[slot]),
            reason=REASONS[reason],
            path=PATHS[path],
            req_id=self._request_id(int(self._batch_req[slot])),
        )

    def _ordinal(self, req_id: str | None) -> int:
        """The ordinal of ``req_id`` among the remembered ids (a new one, the oldest forgotten, when it is not
        remembered); 0 for none."""
        if req_id is None:
            return 0
        data = req_id.encode("utf-8", "surrogatepass")
        ordinal = self._ordinal_of_id.get(data)
        if ordinal is not None:
            return ordinal
        ordinal = self._next_ordinal
        self._next_ordinal = ordinal % 0xFFFFFFFF + 1  # uint32, never 0
        slot = ordinal % self.request_ids
        forgotten = self._id_of_ordinal[slot]
        if forgotten is not None:
            del self._ordinal_of_id[forgotten]
            self._id_bytes -= len(forgotten)
        self._id_of_ordinal[slot] = data
        self._ordinal_of_id[data] = ordinal
        self._id_bytes += len(data)
        return ordinal

    def _request_id(self, ordinal: int) -> str | None:
        """The id of ordinal ``ordinal``; None for none, or once it is forgotten."""
        if ordinal == 0:
            return None
        data = self._id_of_ordinal[ordinal % self.request_ids]
        if data is None or self._ordinal_of_id.get(data) != ordinal:
            return None
        return data.decode("utf-8", "surrogatepass")

    def removal_at(self, serial: int) -> Removal | None:
        """The batch with this serial, if the history still holds its details."""
        self._fold()
        if not self._oldest_live_serial() <= serial < self._batches_folded:
            return None
        return self._removal(serial)

    def last_removals(self, keys: Sequence[bytes]) -> list[Removal | None]:
        """The most recent removal of each key, or None where none is recorded."""
        return self._removals(keys, None)

    def first_removals(self, keys: Sequence[bytes], since: Sequence[int]) -> list[Removal | None]:
        """For each key, its first removal with a serial >= ``since[i]`` (the removal that broke a
        promise made at that serial), or None where none is recorded with its details."""
        return self._removals(keys, np.asarray(since, dtype=np.int64))

    def _removals(self, keys: Sequence[bytes], since: np.ndarray | None) -> list[Removal | None]:
        self._fold()
        filled = min(self._keys_written, self.capacity)
        if not filled or not keys:
            return [None] * len(keys)
        ring = self._key_fp[:filled]
        wanted = fingerprints(keys, len(keys))
        if len(keys) >= _SORT_JOIN_KEYS:
            serials = self._sorted_join(ring, wanted, since)
        else:
            serials = self._scan(ring, wanted, since)
        oldest_live = self._oldest_live_serial()
        return [self._removal(serial) if serial >= oldest_live else None for serial in serials]

    def _scan(self, ring: np.ndarray, wanted: np.ndarray, since: np.ndarray | None) -> list[int]:
        """Per key, the serial asked for (-1: none), by scanning the ring for its fingerprint."""
        positions: np.ndarray | None = None
        if len(wanted) >= _PREFILTER_KEYS and len(ring) >= _PREFILTER_RING:
            # One pass over the ring instead of one per key: a 64 Ki-entry table
            # of the wanted fingerprints' low 16 bits picks the few candidates.
            table = np.zeros(1 << 16, dtype=bool)
            table[wanted & 0xFFFF] = True
            positions = np.flatnonzero(np.take(table, ring & 0xFFFF))
            ring = ring[positions]
        out: list[int] = []
        for i, fp in enumerate(wanted.tolist()):
            where = np.flatnonzero(ring == fp)
            if positions is not None:
                where = positions[where]
            serials = self._full_serials(self._key_serial[where])
            if since is not None:
                serials = serials[serials >= since[i]]
            if serials.size == 0:
                out.append(-1)
            else:
                out.append(int(serials.max() if since is None else serials.min()))
        return out

    def _sorted_join(self, ring: np.ndarray, wanted: np.ndarray, since: np.ndarray | None) -> list[int]:
        """``_scan`` for many keys: O((n + m) log n), not one ring scan per key.

        The keys of a long load (tens of thousands) made per-key scans quadratic: 60,000
        keys over a full 1M-key ring took 14 s on the failing scheduler thread.
        """
        serials = self._full_serials(self._key_serial[: len(ring)])
        order = np.lexsort((serials, ring))  # by fingerprint, then serial
        sorted_fps, sorted_serials = ring[order], serials[order]
        if since is None:  # a fingerprint's run ends with its newest removal
            at = np.searchsorted(sorted_fps, wanted, side="right") - 1
        else:  # the first of a fingerprint's run at or after ``since``: one search on (fingerprint, serial)
            base = int(sorted_serials.min())  # serials held span less than 2**32 batches
            joined = (sorted_fps.astype(np.uint64) << np.uint64(32)) | (sorted_serials - base).astype(np.uint64)
            query = (wanted.astype(np.uint64) << np.uint64(32)) | np.clip(since - base, 0, 2**32 - 1).astype(np.uint64)
            at = np.searchsorted(joined, query, side="left")
        safe = np.clip(at, 0, len(ring) - 1)
        hit = (at >= 0) & (at < len(ring)) & (sorted_fps[safe] == wanted)
        return np.where(hit, sorted_serials[safe], -1).tolist()

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
        """Bytes held by the rings and the remembered request ids (their headers and index estimated)."""
        return (
            self._key_fp.nbytes
            + self._key_serial.nbytes
            + self._batch_time.nbytes
            + self._batch_flags.nbytes
            + self._batch_req.nbytes
            + self._id_bytes
            + _ID_BYTES_OVERHEAD * len(self._ordinal_of_id)
        )
