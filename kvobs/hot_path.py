"""The hot path: what kvobs records on vLLM's scheduler thread, and the one rule it reasons with.

The rule (lookup promises), used alike by the near-miss counter and the diagnosis:

    A lookup that answers HIT or HIT_PENDING makes a *promise*: request R may load key K
    (a later lookup by R replaces it on a HIT and voids it otherwise; R finishing forgets
    it). A removal of K after the promise *breaks* it, and the first such removal is the
    one that made it false. A load by R that asks for K is a *near miss* when K's last
    removal came after the promise (and after the last load that counted it); it counts
    under the reason of the first removal after the promise. A missing key's cause is the
    reason of that same first removal.

Here, on the hot path: promises per request, and the serial of each recently removed key's
last removal (:class:`RecentRemovals`), so a load tells a near miss from a plain hit with a
dictionary lookup per key. That memory is short, so it answers only for promises it reaches
back to (``RecentRemovals.exact_from``), where its answer is exactly the history's; a load's
older promises are handed to the observer undecided, and the eviction history decides them,
as it decides the cause (issue 21: the two disagreed once the short memory had forgotten).
Which removal came first after a promise is always asked of the eviction history, only for
near misses and at a failed load; where the history no longer holds it, the cause says
``unknown`` and no near miss is counted: the evidence is gone for both alike.

Everything else about a removal batch (history, counters, sinks) is queued and folded by the
observer in bulk (``Recorder.take_run``): when the queue reaches ``drain_keys`` keys or
``drain_batches`` batches, whenever anything reads the evidence, and when the journal's
writer wakes.

A *tap* stands in for one of vLLM's bound methods: it calls it with the caller's exact
arguments, returns its result or lets its exception through untouched, and records around
it. Taps never raise anything of kvobs's own: faults go to ``on_error(stage, exc)``.

One source, two forms: this module runs as plain Python, and setup.py compiles it with
mypyc where a C compiler is present (``kvobs.hot_path_loader`` picks which; docs/design.md).
Nothing here imports vLLM or numpy: the LookupResult members a lookup tap compares against
are handed in.
"""

from __future__ import annotations

import copy
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from threading import get_ident
from typing import Any, NamedTuple

from kvobs.codes import (
    CAPACITY,
    DEFERRED_RELEASE,
    DRAIN_BATCHES,
    DRAIN_KEYS,
    REASON_BITS,
    REASONS,
    RECENT_KEYS,
    RESET,
    STORE_FAILED,
)

monotonic = time.monotonic
_UNKNOWN = float("nan")
_NUM_REASONS: int = len(REASONS)
_REASON_BITS: int = REASON_BITS


class Verdict(NamedTuple):
    """One promise: when the lookup answered (removal serial and monotonic time), and whether pending."""

    serial: int
    time: float
    pending: bool


class Breach(NamedTuple):
    """The removal that broke a promise: its batch serial and reason code (``kvobs.codes.REASONS``)."""

    serial: int
    reason: int


class NearMiss(NamedTuple):
    """A load asked for a key whose promise a removal broke (``breach``: the first such removal,
    None when the history no longer holds it)."""

    req_id: str
    key: bytes
    verdict: Verdict
    breach: Breach | None


class RemovalRun(NamedTuple):
    """Queued removal batches, column by column (native int64 / float64 / uint8 arrays).

    Batch ``i`` has serial ``first_serial + i``, ``counts[i]`` keys (in ``keys``, their ``hash()``
    in ``hashes``), time ``times[i]``, flags ``flags[i]`` (``kvobs.codes.pack_flags``) and request
    ``reqs[i]``. ``residency``, kept only while a sink needs it, has each key's store-to-removal
    seconds, NaN where unknown.
    """

    first_serial: int
    hashes: array
    counts: array
    times: array
    flags: array
    reqs: list[str | None]
    keys: list[bytes]
    residency: array | None


class _Request:
    """One request's promises.

    A promise is stored as one int, ``serial << 1 | pending``: the same int object for every key
    a lookup pass promises (no allocation per hit, nothing for the GC, little to free at finish).
    Its time is the request's latest lookup time.
    """

    def __init__(self) -> None:
        self.verdicts: dict[bytes, int] = {}
        self.time = 0.0  # monotonic time of the request's latest positive lookup
        self.counted: dict[bytes, int] | None = None  # key -> serial up to which its near miss was counted
        self.incomplete = False  # a promise did not fit (max_entries): a missing one proves nothing

    def verdict(self, code: int) -> Verdict:
        return Verdict(code >> 1, self.time, bool(code & 1))


class RecentRemovals:
    """The serial of the last removal of each recently removed key.

    Two generations of ``size`` keys each: a key is remembered for at least ``size`` and at
    most ``2 * size`` removed keys after its removal (the observer sizes this below the
    history, so the history still holds every removal this remembers). ``exact_from`` is the
    first serial from which every removal is remembered: for a promise at or after it, "removed
    since the promise" is answered exactly; an older promise it cannot answer. A reset whose
    keys could not be listed counts as a removal of every key.
    """

    def __init__(self, size: int) -> None:
        self._size = max(1, size)
        # Keyed by the key's hash, not the key: vLLM's key objects are freed when vLLM drops them
        # (64-bit hashes of a few ten thousand keys collide with odds near 1e-10).
        self._new: dict[int, int] = {}
        self._old: dict[int, int] = {}
        self._new_first = 0  # serial of the first batch the current new generation holds
        self.exact_from = 0
        self.unlisted_reset = -1  # serial of the last reset that removed keys nobody could list

    def add(self, keys: list[bytes], serial: int) -> None:
        new = self._new
        for key in keys:
            new[hash(key)] = serial
        if len(new) >= self._size:
            self._old = new  # the generation dropped held only removals before this one's first
            self.exact_from = self._new_first
            self._new_first = serial + 1
            self._new = {}

    def last(self, key: bytes) -> int:
        """Serial of the key's last removal remembered here, -1 if none."""
        fingerprint = hash(key)
        serial = self._new.get(fingerprint)
        if serial is None:
            serial = self._old.get(fingerprint, -1)
        return serial if serial > self.unlisted_reset else self.unlisted_reset

    def __len__(self) -> int:
        return len(self._new) + len(self._old)


class Promises:
    """The promises of every live request (see the module docstring).

    Bounded: at most ``max_entries`` promises across all requests; one that does not fit is
    dropped and counted (``dropped``), and its request is marked ``incomplete``. Not
    thread-safe by itself: vLLM calls the manager under its lock.
    """

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self.dropped = 0
        self._entries = 0
        self._requests: dict[str, _Request] = {}

    def __len__(self) -> int:
        return self._entries

    def reported(self, req_id: str, key: bytes, code: int, now: float) -> None:
        """A lookup by ``req_id`` answered HIT / HIT_PENDING for ``key`` at ``now``: a fresh promise.

        ``code`` is ``serial << 1 | pending``: the serial the next removal gets, and whether the
        answer was HIT_PENDING.
        """
        req = self._requests.get(req_id)
        if req is None:
            req = self._requests[req_id] = _Request()
        verdicts = req.verdicts
        if key not in verdicts:
            if self._entries >= self.max_entries:
                self.dropped += 1
                req.incomplete = True
                return
            self._entries += 1
        verdicts[key] = code
        req.time = now

    def not_reported(self, req_id: str, key: bytes) -> None:
        """A later lookup by ``req_id`` answered MISS / RETRY for ``key``: its promise is void."""
        req = self._requests.get(req_id)
        if req is None or req.verdicts.pop(key, None) is None:
            return
        self._entries -= 1
        if not req.verdicts and not req.incomplete:
            del self._requests[req_id]

    def redeemed(
        self, req_id: str, keys: Iterable[bytes], recent: RecentRemovals, now_serial: int
    ) -> list[tuple[bytes, Verdict, bool]]:
        """A load by ``req_id`` asks for ``keys``: its near misses, ``(key, promise, True)``, and the
        promises ``recent`` cannot judge (older than its memory), ``(key, promise, False)``, for the
        observer to decide from the eviction history with :meth:`settle`.

        ``now_serial`` is the serial the next removal will get: a near miss is counted once,
        until the key is removed again.
        """
        req = self._requests.get(req_id)
        if req is None:
            return []
        verdicts = req.verdicts
        exact_from = recent.exact_from
        found: list[tuple[bytes, Verdict, bool]] = []
        for key in keys:
            code = verdicts.get(key)
            if code is None:
                continue
            since = code >> 1
            if since < exact_from:  # older than the short memory: the history decides
                found.append((key, req.verdict(code), False))
                continue
            last = recent.last(key)
            if last < since:
                continue
            if _count_once(req, key, last, now_serial):
                found.append((key, req.verdict(code), True))
        return found

    def settle(self, req_id: str, key: bytes, last: int, now_serial: int) -> bool:
        """A promise :meth:`redeemed` left undecided, whose key's last removal (serial ``last``) came
        after the promise: True if it is a near miss not counted yet (and now counted)."""
        req = self._requests.get(req_id)
        return req is not None and _count_once(req, key, last, now_serial)

    def finished(self, req_id: str) -> None:
        """The request is gone: forget its promises."""
        req = self._requests.pop(req_id, None)
        if req is not None:
            self._entries -= len(req.verdicts)

    def verdict(self, req_id: str, key: bytes) -> Verdict | None:
        req = self._requests.get(req_id)
        code = None if req is None else req.verdicts.get(key)
        return None if req is None or code is None else req.verdict(code)

    def incomplete(self, req_id: str) -> bool:
        """True if a promise of this request was dropped (a missing promise then proves nothing)."""
        req = self._requests.get(req_id)
        return req is not None and req.incomplete

    def clear(self) -> None:
        self._requests.clear()
        self._entries = 0


def _count_once(req: _Request, key: bytes, last: int, now_serial: int) -> bool:
    """The one count-once rule: a broken promise counts at the first load after its key's last
    removal (serial ``last``), and again only after another removal."""
    counted = req.counted
    if counted is None:
        counted = req.counted = {}
    elif counted.get(key, -1) > last:
        return False
    counted[key] = now_serial
    return True


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], pos: int, name: str) -> Any:
    """A call's argument by position, else by keyword (taps see the caller's exact arguments)."""
    if 0 <= pos < len(args):
        return args[pos]
    return kwargs.get(name)


class Recorder:
    """Taps, the promise table and the removal queue of one observed manager.

    ``on_full()`` is called (outside any lock) when the queue asks to be drained;
    ``off_thread_path()`` names the path of a removal on a thread with no tapped call.
    """

    def __init__(
        self,
        *,
        max_verdicts: int,
        num_stamps: int,
        on_error: Callable[[str, BaseException], None],
        on_full: Callable[[], None],
        off_thread_path: Callable[[], int],
        recent_keys: int = RECENT_KEYS,
        drain_keys: int = DRAIN_KEYS,
        drain_batches: int = DRAIN_BATCHES,
    ) -> None:
        self.promises = Promises(max_verdicts)
        self.recent = RecentRemovals(recent_keys)
        self.on_error = on_error
        self._on_full = on_full
        self._off_thread_path = off_thread_path
        self._drain_keys = drain_keys
        self._drain_batches = drain_batches
        self._stamps = array("d", bytes(8 * max(0, num_stamps)))
        self._lock = threading.Lock()
        self._serial = 0
        self._code = 0  # self._serial << 1: one int object, shared by every promise made until the next removal
        self._first_serial = 0
        self.keep_residency = False
        """Whether batches keep each key's residency (only while a sink needs it)."""
        self._evicted = [0] * len(REASONS)
        self._batches = [0] * len(REASONS)
        self._unread = [0] * len(REASONS)
        self.stored = 0
        """Chunks the CPU tier took to store (``prepare_store``'s ``keys_to_store``)."""
        self.loaded = 0
        """Chunks loaded from the CPU tier (``prepare_load`` calls that succeeded)."""
        # A bit per CPU-tier slot: set when its chunk is loaded, cleared when the chunk is removed, so a
        # removal tells a chunk never read since its store (issue 29: "is the tier doing anything").
        self._read = bytearray((max(0, num_stamps) + 7) >> 3)
        self.chunk_of: Callable[[bytes], Any] | None = None
        """The CPU tier's chunk for a key (its policy's ``get``), set when the policy is hooked."""
        # Which tapped call is running: (path code, request context, thread id), or None.
        self.frame: tuple[int, Any, int] | None = None
        self._new_columns()

    def _new_columns(self) -> None:
        # Plain lists: appending to them is the cheapest thing the scheduler thread can do;
        # take_run() turns them into arrays on the thread that drains.
        self._q_keys: list[bytes] = []
        self._q_counts: list[int] = []
        self._q_times: list[float] = []
        self._q_flags: list[int] = []
        self._q_reqs: list[str | None] = []
        self._q_res: list[float] = []

    # -- the queue ----------------------------------------------------------------------

    @property
    def next_serial(self) -> int:
        """The serial the next removal batch gets; a promise remembers it."""
        return self._serial

    @property
    def pending(self) -> int:
        """Batches queued and not yet taken."""
        return len(self._q_reqs)

    def take_run(self) -> RemovalRun:
        """Everything queued, as one run (empty when nothing is); the queue starts afresh."""
        with self._lock:
            first, keys, counts, times = self._first_serial, self._q_keys, self._q_counts, self._q_times
            flags, reqs, res = self._q_flags, self._q_reqs, self._q_res
            self._first_serial = self._serial
            self._new_columns()
        return RemovalRun(
            first, array("q", map(hash, keys)), array("q", counts), array("d", times), array("B", flags), reqs, keys,
            array("d", res) if len(res) == len(keys) and res else None,
        )

    def totals(self) -> tuple[list[int], list[int]]:
        """(chunks removed, removal batches) by reason code, counted as batches are queued."""
        return list(self._evicted), list(self._batches)

    def unread(self) -> list[int]:
        """Chunks removed that were never loaded since their store, by reason code."""
        return list(self._unread)

    def removal(
        self,
        keys: list[bytes],
        reason: int,
        residency: Sequence[float] | None,
        now: float,
        *,
        path: int = -1,
        req_id: str | None = None,
        unlisted: bool = False,
        chunk_ids: Sequence[int] | None = None,
    ) -> None:
        """Queue one removal batch (``path`` -1: from the frame). ``unlisted``: a reset whose keys
        could not be listed, taken as a removal of every key. ``chunk_ids``: the removed chunks'
        slots, whose read bits say which were never loaded; None: none was (a store that failed)."""
        if not 0 <= reason < _NUM_REASONS:
            raise ValueError(f"bad reason code {reason}")
        if path < 0:
            frame = self.frame
            if frame is not None and frame[2] == get_ident():
                path = frame[0]
                req = frame[1]
                req_id = None if req is None else req.req_id
            else:
                path = self._off_thread_path()
        n = len(keys)
        lock = self._lock
        lock.acquire()
        try:
            serial = self._serial
            self._serial = serial + 1
            self._code = (serial + 1) << 1
            if unlisted:
                self.recent.unlisted_reset = serial
            else:
                self.recent.add(keys, serial)
            queued = self._q_keys
            queued.extend(keys)
            self._q_counts.append(n)
            self._q_times.append(now)
            self._q_flags.append(reason | (path << _REASON_BITS))  # kvobs.codes.pack_flags
            reqs = self._q_reqs
            reqs.append(req_id)
            if self.keep_residency:
                if residency is not None and len(residency) == n:
                    self._q_res.extend(residency)
                else:
                    self._q_res.extend([_UNKNOWN] * n)
            self._evicted[reason] += n
            self._batches[reason] += 1
            read = self._read
            if unlisted:
                read[:] = bytes(len(read))  # nothing to tell the chunks apart by: none counts as unread
            elif chunk_ids is None:
                self._unread[reason] += n
            else:
                size = len(read) << 3
                unread = n
                for cid in chunk_ids:
                    if 0 <= cid < size:
                        bit = 1 << (cid & 7)
                        if read[cid >> 3] & bit:
                            read[cid >> 3] ^= bit
                            unread -= 1
                self._unread[reason] += unread
            full = len(queued) >= self._drain_keys or len(reqs) >= self._drain_batches
        finally:
            lock.release()
        if full:
            try:
                self._on_full()
            except Exception as exc:
                self.on_error("record.removal", exc)

    # -- residency (store -> removal), only while batches keep their keys ---------------

    def ages(self, chunk_ids: Iterable[int], now: float) -> list[float]:
        """Seconds since each chunk slot was stamped (NaN for a slot never stamped)."""
        stamps = self._stamps
        size = len(stamps)
        out: list[float] = []
        for cid in chunk_ids:
            stamp = stamps[cid] if 0 <= cid < size else 0.0
            out.append(now - stamp if stamp else _UNKNOWN)
        return out

    def mark_loaded(self, keys: Any) -> None:
        """A load of ``keys`` succeeded: counted, and each chunk's read bit set."""
        chunk_of = self.chunk_of
        lock = self._lock
        lock.acquire()
        try:
            self.loaded += len(keys)
            if chunk_of is not None:
                read = self._read
                size = len(read) << 3
                for key in keys:
                    chunk = chunk_of(key)
                    if chunk is not None:
                        cid = chunk.chunk_id
                        if 0 <= cid < size:
                            read[cid >> 3] |= 1 << (cid & 7)
        finally:
            lock.release()

    def stamp(self, chunk_id: int, now: float) -> None:
        """The chunk slot was filled now."""
        if 0 <= chunk_id < len(self._stamps):
            self._stamps[chunk_id] = now

    # -- the manager's taps -------------------------------------------------------------

    def lookup_tap(
        self, inner: Callable[..., Any], *, path: int, hit: object, hit_pending: object, marks_frame: bool
    ) -> LookupTap:
        """``lookup(key, req_context, **kw)``: a promise per HIT / HIT_PENDING, a void per other answer.

        ``marks_frame``: the lookup can remove chunks (tiering promotions), so removals
        under it are attributed to it.
        """
        return LookupTap(self, inner, path, hit, hit_pending, marks_frame)

    def keys_tap(self, inner: Callable[..., Any], *, path: int) -> KeysTap:
        """``method(keys, req_context, ...)`` (``prepare_store``, ``complete_store``): removals under it
        are attributed to ``path`` and the request."""
        return KeysTap(self, inner, path)

    def store_tap(self, inner: Callable[..., Any], *, path: int) -> StoreTap:
        """``prepare_store(keys, req_context)``: as :meth:`keys_tap`, and counts the chunks it took to store."""
        return StoreTap(self, inner, path)

    def request_tap(self, inner: Callable[..., Any], *, path: int) -> RequestTap:
        """``on_request_finished(req_context, **kw)``: removals under it attributed; then the request is gone."""
        return RequestTap(self, inner, path)

    def call_tap(self, inner: Callable[..., Any], *, path: int) -> CallTap:
        """Any other call that can remove chunks (``on_schedule_end``, ``reset_cache``): attributed to ``path``."""
        return CallTap(self, inner, path)

    def load_tap(
        self,
        inner: Callable[..., Any],
        *,
        on_failure: Callable[[AssertionError, Any, Any], object],
        on_near: Callable[[str, list[tuple[bytes, Verdict, bool]]], object],
    ) -> LoadTap:
        """``prepare_load(keys, req_context)``: ``on_near(req_id, Promises.redeemed(...))`` for near misses
        (and promises left to the history) on success; ``on_failure`` on vLLM's assertion.

        ``on_failure(exc, keys, req_context)`` runs before the assertion propagates (it appends
        the explanation to the same exception object); the assertion then leaves unchanged otherwise.
        What it returns decides: None, the assertion goes on (always, unless survive mode is on);
        anything else is returned instead (survive mode's load source, kvobs/vllm/survive.py).
        """
        return LoadTap(self, inner, on_failure, on_near)


# The taps are classes with vLLM's own parameter names, not ``*args, **kwargs`` closures: compiled,
# a call then costs about 20 ns instead of 80-130 (docs/performance.md). An optional parameter
# (``exclude_tier_idx``, ``success``) is forwarded only when the caller gave it, so the inner method
# sees exactly what the caller passed and raises what it would raise; kvobs.vllm.compat checks that
# vLLM's methods take these parameters.

_ABSENT: Any = object()


class LookupTap:
    def __init__(
        self, rec: Recorder, inner: Callable[..., Any], path: int, hit: object, hit_pending: object, marks_frame: bool
    ) -> None:
        self.rec = rec
        self.inner = inner
        self.path = path
        self.hit = hit
        self.hit_pending = hit_pending
        self.marks_frame = marks_frame

    def __call__(self, key: bytes, req_context: Any, *, exclude_tier_idx: Any = _ABSENT) -> Any:
        rec = self.rec
        if self.marks_frame:
            before = rec.frame
            rec.frame = (self.path, req_context, get_ident())
            try:
                if exclude_tier_idx is _ABSENT:
                    result = self.inner(key, req_context)
                else:
                    result = self.inner(key, req_context, exclude_tier_idx=exclude_tier_idx)
            finally:
                rec.frame = before
        elif exclude_tier_idx is _ABSENT:
            result = self.inner(key, req_context)
        else:
            result = self.inner(key, req_context, exclude_tier_idx=exclude_tier_idx)
        try:
            if result is self.hit:
                rec.promises.reported(req_context.req_id, key, rec._code, monotonic())
            elif result is self.hit_pending:
                rec.promises.reported(req_context.req_id, key, rec._code | 1, monotonic())
            else:
                rec.promises.not_reported(req_context.req_id, key)
        except Exception as exc:
            rec.on_error("record.lookup", exc)
        return result


class KeysTap:
    def __init__(self, rec: Recorder, inner: Callable[..., Any], path: int) -> None:
        self.rec = rec
        self.inner = inner
        self.path = path

    def __call__(self, keys: Any, req_context: Any, success: Any = _ABSENT) -> Any:
        rec = self.rec
        before = rec.frame
        rec.frame = (self.path, req_context, get_ident())
        try:
            if success is _ABSENT:
                return self.inner(keys, req_context)
            return self.inner(keys, req_context, success)
        finally:
            rec.frame = before


class StoreTap:
    def __init__(self, rec: Recorder, inner: Callable[..., Any], path: int) -> None:
        self.rec = rec
        self.inner = inner
        self.path = path

    def __call__(self, keys: Any, req_context: Any) -> Any:
        rec = self.rec
        before = rec.frame
        rec.frame = (self.path, req_context, get_ident())
        try:
            result = self.inner(keys, req_context)
        finally:
            rec.frame = before
        if result is not None:
            try:
                rec.stored += len(result.keys_to_store)  # kvobs.vllm.compat.STORED_FIELD
            except Exception as exc:
                rec.on_error("record.store", exc)
        return result


class RequestTap:
    def __init__(self, rec: Recorder, inner: Callable[..., Any], path: int) -> None:
        self.rec = rec
        self.inner = inner
        self.path = path

    def __call__(self, req_context: Any, *, exclude_tier_idx: Any = _ABSENT) -> Any:
        rec = self.rec
        before = rec.frame
        rec.frame = (self.path, req_context, get_ident())
        try:
            if exclude_tier_idx is _ABSENT:
                result = self.inner(req_context)
            else:
                result = self.inner(req_context, exclude_tier_idx=exclude_tier_idx)
        finally:
            rec.frame = before
        try:
            rec.promises.finished(req_context.req_id)
        except Exception as exc:
            rec.on_error("record.finish", exc)
        return result


class CallTap:
    def __init__(self, rec: Recorder, inner: Callable[..., Any], path: int) -> None:
        self.rec = rec
        self.inner = inner
        self.path = path

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        rec = self.rec
        before = rec.frame
        rec.frame = (self.path, None, get_ident())
        try:
            return self.inner(*args, **kwargs)
        finally:
            rec.frame = before


class LoadTap:
    def __init__(
        self,
        rec: Recorder,
        inner: Callable[..., Any],
        on_failure: Callable[[AssertionError, Any, Any], object],
        on_near: Callable[[str, list[tuple[bytes, Verdict, bool]]], object],
    ) -> None:
        self.rec = rec
        self.inner = inner
        self.on_failure = on_failure
        self.on_near = on_near

    def __call__(self, keys: Any, req_context: Any) -> Any:
        try:
            result = self.inner(keys, req_context)
        except AssertionError as exc:
            self.redeem(keys, req_context)  # before the diagnosis, which counts these near misses too
            instead: object = None
            try:
                instead = self.on_failure(exc, keys, req_context)
            except Exception as fault:
                self.rec.on_error("diagnosis", fault)
            if instead is None:
                raise
            return instead  # survive mode's decision, made once, in the failure callback
        self.redeem(keys, req_context)
        try:
            self.rec.mark_loaded(keys)
        except Exception as exc:
            self.rec.on_error("record.load", exc)
        return result

    def redeem(self, keys: Any, req_context: Any) -> None:
        """The load's near misses, the one place they are redeemed, whether the load succeeded or not."""
        rec = self.rec
        try:
            req_id = req_context.req_id
            broken = rec.promises.redeemed(req_id, keys, rec.recent, rec._serial)
            if broken:
                self.on_near(req_id, broken)
        except Exception as exc:
            rec.on_error("record.load", exc)


class PolicyTap:
    """A tap set on vLLM's cache policy (or the CPU manager) as an instance attribute.

    A copy or a pickle of the object it sits on gets the plain method back, not the tap:
    the copy is unobserved (as a copy of the bare manager would be), and never reaches into
    this recorder.
    """

    def __init__(self, recorder: Recorder, inner: Callable[..., Any]) -> None:
        self.recorder = recorder
        self.inner = inner

    # Defined here too, not only in the subclasses: mypyc 2.4 compiles a __call__ that only a
    # subclass defines into a class whose instances crash when called (tests/unit/testhot_path.py).
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)

    def __reduce__(self) -> Any:
        return self.inner.__reduce__()

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return copy.deepcopy(self.inner, memo)


class EvictTap(PolicyTap):
    """``policy.evict(...) -> [(key, chunk)] | None``: a capacity removal batch."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        evicted = self.inner(*args, **kwargs)
        if evicted:
            rec = self.recorder
            try:
                now = monotonic()
                keys = [key for key, _ in evicted]
                ids = [chunk.chunk_id for _, chunk in evicted]
                rec.removal(keys, CAPACITY, rec.ages(ids, now) if rec.keep_residency else None, now, chunk_ids=ids)
            except Exception as exc:
                rec.on_error("record.removal", exc)
        return evicted


class RemoveTap(PolicyTap):
    """``policy.remove(key)``: a failed store's removal, attributed to the running ``complete_store``
    (or, while :class:`DeferredReleaseTap` runs, a deferred write release)."""

    def __init__(self, recorder: Recorder, inner: Callable[..., Any], chunk_of: Callable[[bytes], Any]) -> None:
        super().__init__(recorder, inner)
        self.chunk_of = chunk_of
        self.reason = STORE_FAILED

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        rec = self.recorder
        key = _arg(args, kwargs, 0, "key")
        chunk = None
        try:
            chunk = self.chunk_of(key) if rec.keep_residency else None
        except Exception as exc:
            rec.on_error("record.removal", exc)
        result = self.inner(*args, **kwargs)
        try:
            now = monotonic()
            rec.removal([key], self.reason, None if chunk is None else rec.ages((chunk.chunk_id,), now), now)
        except Exception as exc:
            rec.on_error("record.removal", exc)
        return result


class DeferredReleaseTap(PolicyTap):
    """vLLM 0.34's ``CPUPrimaryTierOffloadingManager.defer_write_release(keys)``: it removes each key
    through ``policy.remove``, which :class:`RemoveTap` then records as ``deferred_release``."""

    def __init__(self, recorder: Recorder, inner: Callable[..., Any], remove: RemoveTap) -> None:
        super().__init__(recorder, inner)
        self.remove = remove

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        remove = self.remove
        remove.reason = DEFERRED_RELEASE
        try:
            return self.inner(*args, **kwargs)
        finally:
            remove.reason = STORE_FAILED


class ClearTap(PolicyTap):
    """``policy.clear()``: a reset; its keys are listed with ``resident()`` before the clear."""

    def __init__(
        self, recorder: Recorder, inner: Callable[..., Any], resident: Callable[[], list[tuple[bytes, Any]]]
    ) -> None:
        super().__init__(recorder, inner)
        self.resident = resident

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        rec = self.recorder
        listed: list[tuple[bytes, Any]] = []
        unlisted = False
        try:
            listed = self.resident()
        except Exception as exc:  # said once; the reset then counts as a removal of every key
            unlisted = True
            rec.on_error("hook", exc)
        result = self.inner(*args, **kwargs)
        try:
            now = monotonic()
            ids = [chunk.chunk_id for _, chunk in listed]
            ages = rec.ages(ids, now) if rec.keep_residency else None
            rec.removal([key for key, _ in listed], RESET, ages, now, unlisted=unlisted, chunk_ids=ids)
        except Exception as exc:
            rec.on_error("record.removal", exc)
        return result


class InsertTap(PolicyTap):
    """``policy.insert(key, chunk, ...)``: stamps the chunk's slot (residency) while keys are kept."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self.inner(*args, **kwargs)
        rec = self.recorder
        if rec.keep_residency:
            try:
                rec.stamp(_arg(args, kwargs, 1, "chunk").chunk_id, monotonic())
            except Exception as exc:
                rec.on_error("record.removal", exc)
        return result
