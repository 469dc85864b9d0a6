"""The hot path: taps around the manager's methods, and removal records queued for the observer.

Why it exists: kvobs runs on vLLM's scheduler thread for every lookup, store and
eviction, where vLLM's own manager spends about a microsecond a call. So the
per-call work is cut to what must happen in order with the manager's own calls:

* a lookup's verdict (``LookupVerdicts.reported``) and the promises a removal
  breaks (``LookupVerdicts.removed``) are recorded at once, because their order
  decides the cause of a failed load;
* everything else about a removal batch (history, counters, sinks) is queued as
  a :data:`Record` with its serial, and folded by the observer in bulk (its
  ``drain``), at the latest when someone reads the evidence, when the queue
  reaches ``drain_keys`` keys or ``drain_batches`` batches, or when the
  journal's writer wakes (every second).

A *tap* is a callable that stands in for one of the inner manager's bound
methods: it calls it with the same arguments and returns its result (or lets
its exception through untouched), and records around it. Taps never raise
anything of kvobs's own: faults go to ``on_error(stage, exc)``.

Two implementations with one behaviour: this module, and its C twin
``kvobs._speedups`` (built when a C compiler is present; see docs/performance.md),
which :func:`new_recorder` prefers. ``tests/unit/test_recorder.py`` runs the
same checks against both.
"""

from __future__ import annotations

import os
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from threading import get_ident
from typing import Any, Protocol

from kvobs.verdicts import LookupVerdicts, NearMiss, Verdict

monotonic = time.monotonic
_new_tuple = tuple.__new__

Record = tuple[int, float, int, int, "str | None", list[bytes], "list[float] | None", int]
"""One removal batch for sinks: (serial, monotonic time, reason code, path code, req_id, keys,
residency seconds or None, broken promises). Queued only while ``keep_batches`` is set."""

Pending = tuple[int, bytes, bytes, bytes, bytes, "list[str | None]", "list[Record] | None", int]
"""The queue as :meth:`PyRecorder.take_pending` hands it over, column by column, numeric columns as
native int64 / float64 arrays (what ``EvictionHistory.record_columns`` reads): (first serial, key
hashes, keys per batch, times, flags = reason | path << 2, req_ids, the full records or None, how
many batches are resets)."""

AFTER_NONE, AFTER_FINISHED, AFTER_PINNED = 0, 1, 2
"""What a call tap does after its call returns: nothing, forget the request, pin the step's new requests."""

DRAIN_KEYS = 16_384
DRAIN_BATCHES = 2_048


class RecorderLike(Protocol):
    """What both implementations offer (the C one is ``kvobs._speedups.Recorder``)."""

    verdicts: Any

    @property
    def next_serial(self) -> int: ...

    keep_batches: int

    @property
    def pending_count(self) -> int: ...

    def take_pending(self) -> Pending: ...

    def totals(self) -> tuple[tuple[int, ...], tuple[int, ...]]: ...

    def removal(
        self, keys: list[bytes], reason: int, residency: list[float] | None, now: float,
        path: int = -1, req_id: str | None = None,
    ) -> None: ...

    def ages(self, chunks: Iterable[Any], now: float) -> list[float]: ...

    def lookup_tap(self, inner: Callable[..., Any], path: int, hit: Any, hit_pending: Any,
                   set_frame: bool) -> Callable[..., Any]: ...

    def call_tap(self, inner: Callable[..., Any], path: int, req_pos: int, after: int) -> Callable[..., Any]: ...

    def load_tap(self, inner: Callable[..., Any], on_failure: Callable[..., Any],
                 on_near: Callable[..., Any]) -> Callable[..., Any]: ...

    def evict_tap(self, inner: Callable[..., Any]) -> Callable[..., Any]: ...

    def allocate_tap(self, inner: Callable[..., Any]) -> Callable[..., Any]: ...


def _req_arg(args: tuple[Any, ...], kwargs: dict[str, Any], pos: int) -> Any:
    if 0 <= pos < len(args):
        return args[pos]
    return kwargs.get("req_context")


class PyRecorder:
    """The reference implementation (and the fallback when the C twin is not built)."""

    def __init__(
        self,
        verdicts: LookupVerdicts,
        reasons: Sequence[str],
        num_stamps: int,
        on_error: Callable[[str, BaseException], None],
        drain: Callable[[], None],
        off_thread_path: Callable[[], int],
        drain_keys: int = DRAIN_KEYS,
        drain_batches: int = DRAIN_BATCHES,
    ) -> None:
        self.verdicts = verdicts
        self._reasons = tuple(reasons)
        self._reset = self._reasons.index("reset")
        self._stamps = [0.0] * max(0, num_stamps)
        self._on_error = on_error
        self._drain = drain
        self._off_thread_path = off_thread_path
        self._drain_keys = drain_keys
        self._drain_batches = drain_batches
        self._lock = threading.Lock()
        self._serial = 0
        self.keep_batches = 0
        self._first_serial = 0
        self._new_columns()
        self._evicted = [0] * len(self._reasons)
        self._batches = [0] * len(self._reasons)
        # Which tapped call is on the stack, for whom, on which thread (removals read it).
        self._path = 0
        self._req: Any = None
        self._thread = 0

    def _new_columns(self) -> None:
        self._p_hashes = array("q")
        self._p_counts = array("q")
        self._p_times = array("d")
        self._p_flags = array("q")
        self._p_reqs: list[str | None] = []
        self._p_batches: list[Record] = []
        self._p_keys = 0
        self._p_resets = 0

    @property
    def next_serial(self) -> int:
        """Serial the next removal batch will get; lookups remember it."""
        return self._serial

    @property
    def pending_count(self) -> int:
        return len(self._p_reqs)

    def take_pending(self) -> Pending:
        with self._lock:
            return self._take_pending()

    def _take_pending(self) -> Pending:
        out = (self._first_serial, self._p_hashes.tobytes(), self._p_counts.tobytes(), self._p_times.tobytes(),
               self._p_flags.tobytes(), self._p_reqs,
               self._p_batches if self.keep_batches or self._p_batches else None, self._p_resets)
        self._new_columns()
        return out

    def totals(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return tuple(self._evicted), tuple(self._batches)

    def removal(
        self, keys: list[bytes], reason: int, residency: list[float] | None, now: float,
        path: int = -1, req_id: str | None = None,
    ) -> None:
        """Queue one removal batch; mark the promises it breaks now (``path`` -1: from the tapped call)."""
        if not 0 <= reason < len(self._reasons):
            raise ValueError(f"bad reason code {reason}")
        if path < 0:
            if self._thread != 0 and self._thread == get_ident():
                path = self._path
                req_id = None if self._req is None else self._req.req_id
            else:
                path = self._off_thread_path()
        hashes = [hash(key) for key in keys]
        verdicts = self.verdicts
        name = self._reasons[reason]
        # Atomic as the C twin's is under the GIL: a drain on another thread (the journal's writer)
        # must never take the columns half-appended.
        with self._lock:
            broken = verdicts.removed_all(name) if reason == self._reset and not keys else verdicts.removed(keys, name)
            serial = self._serial
            if self.keep_batches:
                self._p_batches.append((serial, now, reason, path, req_id, keys, residency, broken))
            if not self._p_reqs:
                self._first_serial = serial
            self._p_hashes.extend(hashes)
            self._p_counts.append(len(keys))
            self._p_times.append(now)
            self._p_flags.append(reason | (path << 2))
            self._p_reqs.append(req_id)
            self._serial = serial + 1
            self._p_keys += len(keys)
            if reason == self._reset:
                self._p_resets += 1
            self._evicted[reason] += len(keys)
            self._batches[reason] += 1
            full = self._p_keys >= self._drain_keys or len(self._p_reqs) >= self._drain_batches
        if full:
            try:
                self._drain()
            except Exception as exc:
                self._on_error("record.removal", exc)

    def ages(self, chunks: Iterable[Any], now: float) -> list[float]:
        """Seconds since each chunk's slot was allocated (slots never stamped are skipped)."""
        stamps = self._stamps
        out = []
        for chunk in chunks:
            cid = chunk.chunk_id
            stamp = stamps[cid] if 0 <= cid < len(stamps) else 0.0
            if stamp:
                out.append(now - stamp)
        return out

    # -- taps ----------------------------------------------------------------------

    def lookup_tap(self, inner: Callable[..., Any], path: int, hit: Any, hit_pending: Any,
                   set_frame: bool) -> Callable[..., Any]:
        verdicts = self.verdicts
        on_error = self._on_error
        rec = self

        def lookup(*args: Any, **kwargs: Any) -> Any:
            req_context = _req_arg(args, kwargs, 1)
            if set_frame:
                rec._path, rec._req, rec._thread = path, req_context, get_ident()
                try:
                    result = inner(*args, **kwargs)
                finally:
                    rec._req, rec._thread = None, 0
            else:
                result = inner(*args, **kwargs)
            try:
                key = args[0] if args else kwargs["key"]
                if result is hit or result is hit_pending:
                    verdicts.reported(
                        req_context.req_id, key, _new_tuple(Verdict, (rec._serial, monotonic(), result is hit_pending))
                    )
                else:
                    verdicts.not_reported(req_context.req_id, key)
            except Exception as exc:
                on_error("record.lookup", exc)
            return result

        return lookup

    def call_tap(self, inner: Callable[..., Any], path: int, req_pos: int, after: int) -> Callable[..., Any]:
        verdicts = self.verdicts
        on_error = self._on_error
        rec = self
        stage = "record.finish" if after == AFTER_FINISHED else "record.schedule_end"

        def call(*args: Any, **kwargs: Any) -> Any:
            req = _req_arg(args, kwargs, req_pos)
            rec._path, rec._req, rec._thread = path, req, get_ident()
            try:
                result = inner(*args, **kwargs)
            finally:
                rec._req, rec._thread = None, 0
            if after:
                try:
                    if after == AFTER_FINISHED:
                        verdicts.finished(req.req_id)
                    else:
                        context = args[0] if args else kwargs["context"]
                        for req_id in context.new_req_ids:  # scheduled this step: their loads are prepared
                            verdicts.pinned(req_id)
                except Exception as exc:
                    on_error(stage, exc)
            return result

        return call

    def load_tap(self, inner: Callable[..., Any], on_failure: Callable[..., Any],
                 on_near: Callable[..., Any]) -> Callable[..., Any]:
        verdicts = self.verdicts
        on_error = self._on_error

        def prepare_load(*args: Any, **kwargs: Any) -> Any:
            try:
                result = inner(*args, **kwargs)
            except AssertionError as exc:
                try:
                    on_failure(exc, args[0] if args else kwargs.get("keys"), _req_arg(args, kwargs, 1))
                except Exception as fault:
                    on_error("diagnosis", fault)
                raise
            try:
                keys = args[0] if args else kwargs["keys"]
                near = verdicts.loaded(_req_arg(args, kwargs, 1).req_id, keys)
                if near:
                    on_near(near)
            except Exception as exc:
                on_error("record.load", exc)
            return result

        return prepare_load

    def evict_tap(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        rec = self
        stamps = self._stamps

        def evict(*args: Any, **kwargs: Any) -> Any:
            evicted = inner(*args, **kwargs)
            if evicted:
                try:
                    now = monotonic()
                    keys = [key for key, _ in evicted]
                    ages = (
                        [now - s for _, chunk in evicted if 0 <= (cid := chunk.chunk_id) < len(stamps)
                         and (s := stamps[cid])] if rec.keep_batches else None
                    )
                    rec.removal(keys, 0, ages, now)
                except Exception as exc:
                    rec._on_error("record.removal", exc)
            return evicted

        return evict

    def allocate_tap(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        rec = self
        stamps = self._stamps
        on_error = self._on_error

        def allocate(*args: Any, **kwargs: Any) -> Any:
            chunks = inner(*args, **kwargs)
            if not rec.keep_batches:  # residency only goes to sinks that take batches
                return chunks
            try:
                now = monotonic()
                for chunk in chunks:
                    stamps[chunk.chunk_id] = now
            except Exception as exc:
                on_error("record.removal", exc)
            return chunks

        return allocate


def speedups_available() -> bool:
    """True when the C twin is built and not disabled (``KVOBS_PURE_PYTHON=1`` disables it)."""
    return _speedups is not None


def speedups_module() -> Any:
    """The built C twin (``kvobs._speedups``), even when disabled for use; None if not built."""
    try:
        from kvobs import _speedups as module  # type: ignore[attr-defined]
    except ImportError:
        return None
    module.configure(Verdict, NearMiss)  # the public types its verdicts are read out as
    return module


def new_recorder(
    max_verdicts: int,
    reasons: Sequence[str],
    num_stamps: int,
    on_error: Callable[[str, BaseException], None],
    drain: Callable[[], None],
    off_thread_path: Callable[[], int],
) -> RecorderLike:
    """A recorder with its verdict table: the C twin when available, else this module's."""
    if _speedups is not None:
        verdicts = _speedups.Verdicts(max_verdicts)
        return _speedups.Recorder(verdicts, tuple(reasons), num_stamps, on_error, drain, off_thread_path,
                                  DRAIN_KEYS, DRAIN_BATCHES)
    return PyRecorder(LookupVerdicts(max_verdicts), reasons, num_stamps, on_error, drain, off_thread_path)


_speedups = None if os.environ.get("KVOBS_PURE_PYTHON", "") not in ("", "0") else speedups_module()
