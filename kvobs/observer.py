"""The recording core: history, lookup verdicts, near misses, diagnosis, sinks.

It knows nothing of vLLM: the glue in ``kvobs.vllm`` tells it what happened
(a removal batch, a lookup answer, a load pinned, a load failed) and it keeps
the evidence, counts, and hands records to sinks. Every sink call is isolated:
a sink's failure is counted and logged once, never raised into the caller.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import NamedTuple

from kvobs.diagnosis import CAUSES, Diagnosis, KeyFacts, LoadFailure, diagnose
from kvobs.history import PATHS, REASONS, EvictionHistory, HistoryStats, Removal
from kvobs.options import Options
from kvobs.recorder import Pending, Record, RecorderLike, new_recorder
from kvobs.verdicts import NearMiss, Verdict

logger = logging.getLogger("kvobs")

STAGES: tuple[str, ...] = (
    "record.removal",
    "record.lookup",
    "record.load",
    "record.finish",
    "record.schedule_end",
    "diagnosis",
    "verdicts",
    "journal",
    "report",
    "tracing",
    "sink",
    "shutdown",
)
"""Where kvobs can drop a record or hit a fault of its own (the ``stage`` label)."""

STATS_EVERY_S = 1.0

_new_verdict = tuple.__new__  # Verdict(...) without its Python-level __new__ (one per lookup hit)
monotonic = time.monotonic

def _overrides(sink: Sink, name: str) -> bool:
    """True if ``sink`` has its own ``name`` method (its class's, or set on the instance)."""
    return getattr(type(sink), name) is not getattr(Sink, name) or name in getattr(sink, "__dict__", ())


def _last_time(times: bytes) -> float:
    """The newest time of a queued run (its times column is native float64)."""
    return float(struct.unpack_from("d", times, len(times) - 8)[0])


REASON_CODE = {name: code for code, name in enumerate(REASONS)}
PATH_CODE = {name: code for code, name in enumerate(PATHS)}
POLL_THREAD_NAME = "vllm_offload_tier_poll"
"""vLLM's tier-poll thread: removals there have no tapped call above them (path ``poll_thread``)."""


class RemovalBatch(NamedTuple):
    """One removal batch as handed to sinks (keys are the vLLM offload keys).

    A named tuple (immutable, and built in a fraction of a frozen dataclass's time:
    one is made per eviction batch on the scheduler thread).
    """

    serial: int
    time: float
    reason: str
    path: str
    req_id: str | None
    keys: Sequence[bytes]
    residency_s: Sequence[float] | None = None
    broken_promises: int = 0
    """Watched lookup hits this batch removed (near misses if their loads then ask for them)."""


class Sink:
    """Receives what the observer records. Methods are no-ops; override what you need."""

    stage: str = "sink"
    """The ``stage`` label this sink's own faults are counted under (one of STAGES)."""

    def on_removal(self, batch: RemovalBatch) -> None:
        """A removal batch was recorded (called, in serial order, on the thread that drains the queue)."""

    def on_removals(self, records: Sequence[Record]) -> None:
        """Many batches at once, in serial order, as the recorder queued them (``kvobs.recorder.Record``).

        Override this instead of :meth:`on_removal` to take them without a ``RemovalBatch``
        each (the journal does); the observer calls one or the other, never both.
        """

    def on_near_miss(self, near_misses: Sequence[NearMiss], reason: str) -> None:
        """Promised chunks were removed before their load."""

    def on_failure(self, diagnosis: Diagnosis, exc: BaseException) -> None:
        """A load failed; called (and must finish, bounded) before the exception leaves kvobs."""

    def close(self) -> None:
        """Flush and release resources."""


class Observer:
    """Keeps the evidence for one offload manager.

    Removal batches arrive through :attr:`recorder` (the taps' queue) and are
    folded into the history, the counters and the sinks by :meth:`drain`, in
    serial order, on whichever thread drains: reading :attr:`history` drains
    first, so readers see every removal queued before the read; :attr:`evicted`
    and :attr:`batches` are counted as batches are queued.
    """

    def __init__(self, options: Options | None = None, sinks: Iterable[Sink] = (), num_stamps: int = 0) -> None:
        self.options = options or Options()
        self._history = EvictionHistory(self.options.history_size)
        self.recorder: RecorderLike = new_recorder(
            self.options.max_verdicts, REASONS, num_stamps, self.internal_error, self._drain_from_tap,
            self._off_thread_path,
        )
        self.verdicts = self.recorder.verdicts
        self.sinks: list[Sink] = list(sinks)
        # Every label value present from the start, so readers on other threads
        # can copy these dicts while they change (their size never does).
        self.near_misses: Counter[str] = Counter(dict.fromkeys(REASONS, 0))
        self.failures: Counter[str] = Counter(dict.fromkeys(CAUSES, 0))
        self.internal_errors: Counter[str] = Counter(dict.fromkeys(STAGES, 0))
        self.last_diagnosis: Diagnosis | None = None
        self.history_stats: HistoryStats = self._history.stats()
        self._next_stats_at = 0.0
        self._sinks_seen: list[Sink] = []
        self._receivers: list[Sink] = []
        self._bulk_receivers: list[Sink] = []
        self._drain_lock = threading.RLock()
        self._draining = False

    # -- the evidence (drained first) ---------------------------------------

    @property
    def history(self) -> EvictionHistory:
        if self.recorder.pending_count:
            self.drain()
        return self._history

    @property
    def evicted(self) -> Counter[str]:
        """Chunks removed, by reason (counted as they are queued: no drain needed)."""
        return Counter(dict(zip(REASONS, self.recorder.totals()[0], strict=True)))

    @property
    def batches(self) -> Counter[str]:
        """Removal batches, by reason."""
        return Counter(dict(zip(REASONS, self.recorder.totals()[1], strict=True)))

    # -- recording -------------------------------------------------------

    def removed(
        self,
        keys: Sequence[bytes],
        reason: str,
        path: str,
        req_id: str | None,
        residency_s: Sequence[float] | None = None,
        now: float | None = None,
    ) -> None:
        """Record one removal batch now (the taps queue theirs through :attr:`recorder` instead)."""
        if now is None:
            now = time.monotonic()
        self._removal_receivers()  # a sink added since the last drain gets this batch too
        self.recorder.removal(
            list(keys), REASON_CODE[reason], None if residency_s is None else list(residency_s), now,
            PATH_CODE[path], req_id,
        )
        self.drain()

    def drain(self, block: bool = True) -> None:
        """Fold every queued removal record, in serial order (``block=False``: skip if another thread is)."""
        lock = self._drain_lock
        if not lock.acquire(blocking=block):
            return
        try:
            if self._draining:  # re-entered from a sink on this thread: the outer drain goes on
                return
            self._draining = True
            try:
                self._removal_receivers()
                recorder = self.recorder
                while recorder.pending_count:
                    self._fold(recorder.take_pending())
            finally:
                self._draining = False
        finally:
            lock.release()

    def _drain_from_tap(self) -> None:
        self.drain(block=False)

    def _off_thread_path(self) -> int:
        return PATH_CODE["poll_thread" if threading.current_thread().name == POLL_THREAD_NAME else "unobserved"]

    def _fold(self, pending: Pending) -> None:
        """History, sinks and gauges for a run of queued batches (called with the drain lock held)."""
        first_serial, hashes, counts, times, flags, reqs, records, resets = pending
        if not counts:
            return
        history = self._history
        try:
            history.record_columns(first_serial, hashes, counts, times, flags, reqs, resets)
        except ValueError as exc:  # the queue and the history disagree: said, never raised
            self.internal_error("record.removal", exc)
        if self._removal_receivers() and records:
            for sink in self._bulk_receivers:
                try:
                    sink.on_removals(records)
                except Exception as exc:  # a sink must never break vLLM
                    self.internal_error(getattr(sink, "stage", "sink"), exc)
            one_by_one = [s for s in self._receivers if s not in self._bulk_receivers]
            if one_by_one:
                for serial, now, reason, path, req_id, keys, residency, broken in records:
                    batch = RemovalBatch(serial, now, REASONS[reason], PATHS[path], req_id, keys, residency, broken)
                    for sink in one_by_one:
                        try:
                            sink.on_removal(batch)
                        except Exception as exc:  # a sink must never break vLLM
                            self.internal_error(getattr(sink, "stage", "sink"), exc)
        now = _last_time(times)
        if now >= self._next_stats_at:  # gauges for other threads, at most once a second
            self._next_stats_at = now + STATS_EVERY_S
            self.history_stats = history.stats()

    def loading(self, req_id: str, keys: Collection[bytes]) -> None:
        """A load by ``req_id`` asks for ``keys``: count the near misses among them."""
        self.near_missed(self.verdicts.loaded(req_id, keys))

    def near_missed(self, near: Sequence[NearMiss]) -> None:
        """Count and publish near misses (promised chunks removed before the load asked for them)."""
        if not near:
            return
        by_reason: dict[str, list[NearMiss]] = {}
        for miss in near:
            by_reason.setdefault(miss.reason, []).append(miss)
        for reason, misses in by_reason.items():
            self.near_misses[reason] += len(misses)
            self._publish_near_misses(misses, reason)

    def _publish_near_misses(self, misses: Sequence[NearMiss], reason: str) -> None:
        self._each_sink("sink", lambda s: s.on_near_miss(misses, reason))

    def refresh_sinks(self) -> None:
        """Re-read :attr:`sinks` now (it is re-read at every drain anyway): whether batches are kept for them."""
        self._removal_receivers()

    def _removal_receivers(self) -> list[Sink]:
        """The sinks with an ``on_removal`` or ``on_removals`` of their own (re-read whenever ``sinks``
        changes); those with ``on_removals`` are also kept apart, in ``_bulk_receivers``.

        A batch is built only when some sink wants it: the tracing sink, always
        present, does not.
        """
        sinks = self.sinks
        if sinks != self._sinks_seen:
            self._sinks_seen = list(sinks)
            self._bulk_receivers = [s for s in sinks if _overrides(s, "on_removals")]
            self._receivers = [s for s in sinks if _overrides(s, "on_removals") or _overrides(s, "on_removal")]
            self.recorder.keep_batches = 1 if self._receivers else 0
        return self._receivers

    def reported(self, req_id: str, key: bytes, pending: bool) -> None:
        """A lookup by ``req_id`` answered HIT (or HIT_PENDING) for ``key``."""
        self.verdicts.reported(req_id, key, _new_verdict(Verdict, (self.recorder.next_serial, monotonic(), pending)))

    def not_reported(self, req_id: str, key: bytes) -> None:
        """A later lookup by ``req_id`` answered MISS/RETRY for ``key``."""
        self.verdicts.not_reported(req_id, key)

    # -- diagnosis -------------------------------------------------------

    def facts(
        self,
        req_id: str,
        unloadable: Sequence[tuple[bytes, int, int | None, str]],
    ) -> list[KeyFacts]:
        """Gather verdicts and removals for (key, group, end_token, state) tuples."""
        removals = self.history.last_removals([k for k, _, _, _ in unloadable])
        out = []
        for (key, group, end_token, state), removal in zip(unloadable, removals, strict=True):
            verdict = self.verdicts.get(req_id, key)
            reset: Removal | None = None
            if verdict is not None and (removal is None or removal.serial < verdict.serial):
                reset = self.history.reset_since(verdict.serial)
            dropped = verdict is None and self.verdicts.incomplete(req_id)
            out.append(KeyFacts(key, group, end_token, state, verdict, removal, reset, dropped))
        return out

    def load_failed(
        self,
        vllm_message: str,
        req_id: str,
        num_keys: int,
        end_token_range: tuple[int, int] | None,
        unloadable: Sequence[tuple[bytes, int, int | None, str]],
        failing_group: int | None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> Diagnosis:
        """Diagnose a failed load and log it once (the history is complete and still while it runs)."""
        with self._drain_lock:
            self.drain()
            now = time.monotonic()
            stats = self._history.stats()
            diagnosis = diagnose(
                LoadFailure(
                    vllm_message=vllm_message,
                    req_id=req_id,
                    num_keys=num_keys,
                    end_token_range=end_token_range,
                    missing=self.facts(req_id, unloadable),
                    history_keys=stats.keys,
                    history_window_s=stats.window(now),
                    now=now,
                    failing_group=failing_group,
                    trace_headers=trace_headers,
                )
            )
        self.failures[diagnosis.cause] += 1
        self.last_diagnosis = diagnosis
        self.history_stats = stats
        logger.error("kv offload load failed: %s", diagnosis.message)
        return diagnosis

    def publish_failure(self, diagnosis: Diagnosis, exc: BaseException) -> None:
        """Hand a failure to every sink (reports, spans); they finish before this returns."""
        self._each_sink("sink", lambda s: s.on_failure(diagnosis, exc))

    # -- fault containment -------------------------------------------------

    def internal_error(self, stage: str, exc: BaseException) -> None:
        """Count a fault of kvobs's own; log the first of each stage."""
        if stage not in self.internal_errors:
            stage = "sink"
        self.internal_errors[stage] += 1
        if self.internal_errors[stage] == 1:
            logger.error("kvobs internal error in %s (counted, not raised): %r", stage, exc)

    def _each_sink(self, stage: str, call: Callable[[Sink], None]) -> None:
        for sink in self.sinks:
            try:
                call(sink)
            except Exception as exc:  # a sink must never break vLLM
                self.internal_error(getattr(sink, "stage", stage) if stage == "sink" else stage, exc)

    def close(self) -> None:
        try:
            self.drain()
        except Exception as exc:
            self.internal_error("record.removal", exc)
        self._each_sink("shutdown", lambda s: s.close())
