"""The hot path's recorder: the capture buffer, its apply, and the removal queue of one observed manager.

The taps (kvobs/hot_taps.py) capture on vLLM's threads; :meth:`Recorder.apply` applies the captures here,
in the order they were made (capture, then apply: kvobs/hot_captures.py).

One source, two forms: the hot path's modules (kvobs/hot_path_modules.py) run as plain Python, and
setup.py compiles them together with mypyc where a C compiler is present (``kvobs.hot_path_loader`` picks
which; docs/design.md). Nothing in them imports vLLM or numpy: the LookupResult members a lookup tap
compares against are handed in.
"""

from __future__ import annotations

import threading
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

from kvobs.capture_ring import CaptureRing
from kvobs.codes import (
    CAPACITY,
    CAPTURE_LIMIT,
    CAPTURE_WAKE,
    CPU_TIER,
    DRAIN_BATCHES,
    DRAIN_KEYS,
    PATH_CODE,
    POLL_THREAD_NAME,
    REASON_BITS,
    REASONS,
    RECENT_KEYS,
)
from kvobs.hot_captures import (
    _CALL,
    _EVICTED,
    _FAILED_LOAD,
    _FINISH,
    _FLAT,
    _LOAD,
    _LOOKUP,
    _PROMOTED,
    _REMOVAL,
    _SNAPSHOT,
    _STORED,
    FlightSegment,
)
from kvobs.hot_promises import Promises, RecentRemovals, RemovalRun, Verdict
from kvobs.hot_taps import (
    CallTap,
    KeysPassTap,
    KeysTap,
    LoadTap,
    LookupTap,
    NewRequestTap,
    PassTap,
    RequestTap,
    StoreTap,
)
from kvobs.metric_catalogue import new_counts

get_ident: Final = threading.get_ident
current_thread: Final = threading.current_thread
# Final, all of these: compiled, a constant is inlined and an object a static read, not a lookup in the
# module's dict on every use.
_UNKNOWN: Final = float("nan")
_NUM_REASONS: Final = len(REASONS)
_REASON_BITS: Final = REASON_BITS
_CAPACITY: Final = CAPACITY
_FLAT_CAPTURE: Final = (_FLAT,)
_NEVER: Final = 1 << 62
_POLL_THREAD_PATH: Final = PATH_CODE["poll_thread"]
_UNOBSERVED_PATH: Final = PATH_CODE["unobserved"]


class Recorder:
    """Taps, the capture buffer, the promise table and the removal queue of one observed manager.

    Evidence flows one way, from here to the observer (kvobs/observer.py): :meth:`apply` hands on what it
    applied through :attr:`near` and the removal queue (:meth:`take_run`), and stops where the observer must
    fold before the next capture is applied (a load's broken promises, judged against the history as it was
    at that load; a full removal queue). Nothing here calls into the observer but ``on_apply()`` (apply
    every capture now, the observer's drain: at the buffer's limit; by default :meth:`apply_all`),
    ``on_backlog()`` (wake kvobs's applier thread, once each time ``capture_wake`` captures wait) and
    ``on_error(stage, exc)`` (count a fault of kvobs's own).
    """

    def __init__(
        self,
        *,
        max_verdicts: int,
        num_stamps: int,
        on_error: Callable[[str, BaseException], None],
        on_apply: Callable[[], None] | None = None,
        on_backlog: Callable[[], None] | None = None,
        recent_keys: int = RECENT_KEYS,
        drain_keys: int = DRAIN_KEYS,
        drain_batches: int = DRAIN_BATCHES,
        capture_wake: int = CAPTURE_WAKE,
        capture_limit: int = CAPTURE_LIMIT,
        counts: dict[str, Any] | None = None,
    ) -> None:
        self.counts: dict[str, Any] = new_counts() if counts is None else counts
        """The engine's counters by totals key (kvobs.metric_catalogue.new_counts; the observer's, which it reads).
        Each counter the taps' captures tell is counted by one line of the fold (:meth:`apply` and what it
        calls): ``self.counts[<totals key>][<label value>] += n``."""
        self.chunk_bytes = 0
        """Bytes of one CPU-tier chunk (kvobs.vllm.compat.chunk_bytes; ``Observer.chunk_bytes`` sets it)."""
        self.promises = Promises(max_verdicts, self.counts["dropped"])
        self.recent = RecentRemovals(recent_keys)
        self.on_error = on_error
        self._on_apply = on_apply
        self._on_backlog = on_backlog
        self._drain_keys = drain_keys
        self._drain_batches = drain_batches
        self.near: list[tuple[str, list[tuple[bytes, Verdict, bool]]]] = []
        """Broken promises of the loads applied and not yet settled by the observer, ``(req_id, redeemed)``
        (``Promises.redeemed``): :meth:`apply` stops after a load that adds one, so the observer judges it
        against the history as it was at that load (``Observer.drain``)."""
        self._fold_first = False  # apply stops after this capture: the observer folds before the next
        # Flat: each capture is its kind and then its fields (kvobs/hot_captures.py's table), added by one call
        # into the ring (kvobs/capture_ring.py: in C, nothing allocated), which no other thread's append can
        # split; popleft() by the applier never loses one.
        self.captures: Any = CaptureRing()
        # Read once: compiled, a tap's call is then an attribute read and a vectorcall, no tuple made.
        self.push: Callable[..., None] = self.captures.push
        """``push(kind, *fields)``: a capture whose fields are all in hand (:meth:`made` counts it)."""
        self.push_timed: Callable[..., None] = self.captures.push_timed
        """``push_timed(kind, *fields)``: as :attr:`push`, then the monotonic time as its last field."""
        self._extend: Callable[[tuple[Any, ...]], None] = self.captures.extend
        self._made = 0  # captures made (on vLLM's threads)
        self._applied = 0  # captures applied (one thread at a time: the observer's drain lock)
        # A call only the flight recorder keeps is captured flat: its method, request id, outcome, key count and
        # flag (a third argument, or None) here, its keys in ``flight_keys``, and ``_FLAT`` alone in ``captures``
        # to keep its place. No object is made or kept alive per call, so none has to be collected
        # (docs/performance.md, issue 32).
        self.flight_items: deque[Any] = deque()
        self.flight_keys: deque[bytes] = deque()
        self._capture_wake = max(1, capture_wake)
        self._capture_limit = max(self._capture_wake, capture_limit)
        self.hit: object = None
        self.hit_pending: object = None
        """The LookupResult members a lookup answers HIT / HIT_PENDING with (set by :meth:`lookup_tap`)."""
        self._stamps = array("d", bytes(8 * max(0, num_stamps)))
        self._lock = threading.Lock()
        self._serial = 0
        self._code = 0  # self._serial << 1: one int object, shared by every promise made until the next removal
        self._first_serial = 0
        self.keep_residency = False
        """Whether batches keep each key's residency (only while a sink needs it)."""
        # A bit per CPU-tier slot: set when its chunk is loaded, cleared when the chunk is removed, so a
        # removal tells a chunk never read since its store (issue 29: "is the tier doing anything").
        self._read = bytearray((max(0, num_stamps) + 7) >> 3)
        self.on_raise: Callable[[str, BaseException, tuple[Any, ...]], None] | None = None
        """Told of an exception leaving vLLM's manager through a tap (:meth:`raised`; kvobs/vllm/manager.py sets it)."""
        self.loaded_chunk_ids: Callable[[Any], Any] | None = None
        """The CPU-tier slots a successful load's result names (kvobs.vllm.compat.loaded_chunk_ids), set when
        the policy is hooked; None: loads are counted, no read bit is set."""
        # Which tapped call is running: (path code, request context, thread id), or None.
        self.frame: tuple[int, Any, int] | None = None
        # The flight recorder (kvobs/flight.py), off until flight_on(): applied calls go to ``flight_segment``,
        # snapshots to ``flight``; every ``_flight_segment`` calls the scheduler thread snapshots the manager's
        # state (``_snapshot``).
        self.flight: Callable[[Any], None] | None = None
        self.flight_segment: FlightSegment | None = None
        self.flight_over: Callable[[FlightSegment], None] | None = None
        """Called (applier side) when ``flight_segment`` crosses its budget (kvobs.flight.FlightWindow.over)."""
        self.flight_calls = False
        """Whether the taps capture the calls only the flight recorder needs (a store, a completion...)."""
        self._snapshot: Callable[[], Any] | None = None
        self.flight_live: dict[str, Any] = {}
        """With the flight recorder on: the request contexts of requests started and not finished, by id (the
        snapshot keeps their state); at most ``flight_live_limit``, the oldest forgotten."""
        self.flight_live_limit = 65_536
        self._flight_segment = _NEVER
        self._flight_left = _NEVER
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

    @property
    def captured(self) -> int:
        """Captures not yet applied (two threads capturing at once may lose a count: then it reads low)."""
        waiting = self._made - self._applied
        return waiting if waiting > 0 and self.captures else 0

    # -- capture and apply ----------------------------------------------------------------

    def capture(self, fields: tuple[Any, ...]) -> None:
        """Append one capture, its kind then its fields (the only recording a tap does on the caller's
        thread). Never raises kvobs's own faults; at the buffer's limit it applies the buffer here."""
        self._extend(fields)
        self.counted()

    def counted(self) -> None:
        """One capture appended (by :meth:`capture`, or by a tap's :attr:`push`): the applier woken once
        ``capture_wake`` wait, the buffer applied here at its limit."""
        self._made += 1
        waiting = self._made - self._applied
        if waiting >= self._capture_wake:
            self._backlogged(waiting)

    def call_captured(self, fields: tuple[Any, ...]) -> None:
        """Capture a manager call that just returned (a boundary between calls: where the flight
        recorder may snapshot the manager's state)."""
        self.capture(fields)
        self.call_ended()

    def call_pushed(self) -> None:
        """A manager call's capture was pushed (:attr:`push`, :attr:`push_timed`) as it returned: counted, and
        the call's end is a boundary (:meth:`call_captured`)."""
        self.counted()
        self.call_ended()

    def call_ended(self) -> None:
        """A manager call returned: where the flight recorder may snapshot the manager's state."""
        self._flight_left -= 1
        if self._flight_left <= 0:
            self.roll()

    def flight_captured(self, method: str, keys: Any, req_context: Any, outcome: Any, flag: bool | None) -> None:
        """Capture, flat, a call only the flight recorder keeps: ``method(keys, ...)`` of the request
        ``req_context`` names (``keys`` None: it took none) that answered ``outcome``, with ``flag`` as its third
        argument (None: not passed; ``complete_store``'s ``success``). Never raises: the request id is read
        here, inside the guard, so a context kvobs does not know turns the recorder off, not vLLM's call into
        an exception."""
        try:
            req_id = req_context.req_id
            count = 0
            if keys is not None:
                count = len(keys)
                self.flight_keys.extend(keys)
            items = self.flight_items
            items.append(method)
            items.append(req_id)
            items.append(outcome)
            items.append(count)
            items.append(flag)
        except Exception as exc:
            self.on_error("flight", exc)
            self.flight_off()
            return
        self.call_captured(_FLAT_CAPTURE)

    def flight_on(self, on_snapshot: Callable[[Any], None], snapshot: Callable[[], Any],
                  segment: int) -> None:
        """Keep a flight recording: every ``segment`` calls (or when ``flight_segment`` is over its budget) the
        state ``snapshot()`` returns is captured between two calls, and handed to ``on_snapshot`` when applied
        (which starts a new ``flight_segment``); every applied call goes to ``flight_segment``."""
        self.flight = on_snapshot
        self._snapshot = snapshot
        self._flight_segment = max(1, segment)
        self.flight_calls = True
        self.roll()

    def flight_off(self) -> None:
        self.flight_calls = False
        self.flight = None
        self.flight_segment = None
        self.flight_over = None
        self._snapshot = None
        self.flight_live = {}
        self._flight_segment = self._flight_left = _NEVER

    def roll_soon(self) -> None:
        """Snapshot after the next call (the flight recorder's window is over its memory budget)."""
        self._flight_left = 0

    def roll(self) -> None:
        """Snapshot the manager's state now, between two calls (with ``flight_live``'s requests); faults turn
        the recorder off."""
        self._flight_left = self._flight_segment
        snapshot = self._snapshot
        if snapshot is None:
            return
        try:
            state = snapshot()
            if state is not None:  # None: the recorder is off now, and says why
                self.capture((_SNAPSHOT, state))
        except Exception as exc:
            self.flight_off()
            self.on_error("flight", exc)

    def _backlogged(self, waiting: int) -> None:
        if waiting >= self._capture_limit:  # full: applied here, so nothing is lost (and counted)
            self.counts["capture"]["full"] += 1  # on vLLM's thread: the event is the capture itself
            self.apply_now("record.removal")
        elif waiting == self._capture_wake and self._on_backlog is not None:
            try:
                self._on_backlog()
            except Exception as exc:
                self.on_error("record.removal", exc)

    def raised(self, method: str, exc: BaseException, args: tuple[Any, ...]) -> None:
        """An exception is leaving vLLM's manager through the tap of ``method`` (the tap re-raises it): told to
        ``on_raise``, never raising (its faults count under ``boundary``)."""
        on_raise = self.on_raise
        if on_raise is not None:
            try:
                on_raise(method, exc, args)
            except Exception as fault:
                self.on_error("boundary", fault)

    def apply_now(self, stage: str) -> None:
        """Every capture applied before this returns (faults counted under ``stage``)."""
        try:
            if self._on_apply is None:
                self.apply_all()
            else:
                self._on_apply()
        except Exception as exc:
            self.on_error(stage, exc)

    def apply_all(self) -> int:
        """Apply every capture waiting now, in order; how many."""
        return self.apply(len(self.captures))

    def apply(self, budget: int) -> int:
        """Apply up to ``budget`` captures, oldest first; how many. One thread at a time (the observer
        holds its drain lock): each capture is applied to the state every earlier one left, as
        recording inline did. A capture that faults is counted under its stage and skipped. Stops early
        after a capture the observer must fold before the next is applied (:attr:`near`, a full removal
        queue); the observer folds, then applies on."""
        pop = self.captures.popleft
        done = 0
        self._fold_first = False
        while done < budget:
            try:
                kind: int = pop()
            except IndexError:
                break
            done += 1
            # Every field is taken before anything is applied: a fault never leaves the next capture misaligned.
            if kind == _LOOKUP:
                key, req_id, result, now = pop(), pop(), pop(), pop()
                try:
                    self._apply_lookup(key, req_id, result, now)
                except Exception as exc:
                    self.on_error("record.lookup", exc)
                segment = self.flight_segment
                if segment is not None:
                    self._flight_add(segment, _LOOKUP, key, req_id, result, None)
            elif kind == _LOAD:
                keys, req_id, result = pop(), pop(), pop()
                try:
                    self._apply_load(keys, req_id, result)
                except Exception as exc:
                    self.on_error("record.load", exc)
                segment = self.flight_segment
                if segment is not None:
                    self._flight_add(segment, _LOAD, keys, req_id, True, None)
                if self._fold_first:
                    break
            elif kind == _FAILED_LOAD:  # its near misses, as a load's (the bundle keeps the call itself)
                keys, req_id = pop(), pop()
                try:
                    self.redeem(keys, req_id)
                except Exception as exc:
                    self.on_error("record.load", exc)
                if self._fold_first:
                    break
            elif kind == _FINISH:
                req_id = pop()
                try:
                    self.promises.finished(req_id)
                except Exception as exc:
                    self.on_error("record.finish", exc)
                segment = self.flight_segment
                if segment is not None:
                    self._flight_add(segment, _FINISH, None, req_id, None, None)
            elif kind == _EVICTED:
                pairs, now, path, req_id, residency = pop(), pop(), pop(), pop(), pop()
                try:
                    self._apply_removal([key for key, _ in pairs], _CAPACITY, residency, now, path, req_id, False,
                                        [chunk.chunk_id for _, chunk in pairs])
                except Exception as exc:
                    self.on_error("record.removal", exc)
                if self._fold_first:
                    break
            elif kind == _REMOVAL:
                keys, reason, residency, now = pop(), pop(), pop(), pop()
                path, req_id, unlisted, chunk_ids = pop(), pop(), pop(), pop()
                try:
                    self._apply_removal(keys, reason, residency, now, path, req_id, unlisted, chunk_ids)
                except Exception as exc:
                    self.on_error("record.removal", exc)
                if self._fold_first:
                    break
            elif kind == _STORED:  # chunks the CPU tier took to store (prepare_store's keys_to_store)
                n = pop()
                self.counts["stored"][CPU_TIER] += n
                self.counts["stored_bytes"][CPU_TIER] += n * self.chunk_bytes
                self.counts["written"][CPU_TIER] += n
            elif kind == _PROMOTED:  # chunks a tiering manager's promotion wrote into the CPU tier (WriteTap)
                self.counts["written"][CPU_TIER] += pop()
            elif kind == _FLAT:  # a call only the flight recorder keeps, its parts in order
                self._apply_flat()
            elif kind == _CALL:
                name, args, kwargs, outcome = pop(), pop(), pop(), pop()
                segment = self.flight_segment
                if segment is not None:
                    self._flight_add(segment, _CALL, name, args, kwargs, outcome)
            elif kind == _SNAPSHOT:
                state = pop()
                on_snapshot = self.flight
                if on_snapshot is not None:
                    try:
                        on_snapshot(state)
                    except Exception as exc:
                        self.on_error("flight", exc)
        self._applied += done
        return done

    def _flight_add(self, segment: FlightSegment, kind: int, first: Any, second: Any, third: Any, fourth: Any) -> None:
        """An applied call into the flight recorder's segment (:meth:`FlightSegment.add_fields`)."""
        try:
            if segment.add_fields(kind, first, second, third, fourth):
                self._flight_over(segment)
        except Exception as exc:
            self.on_error("flight", exc)

    def _flight_over(self, segment: FlightSegment) -> None:
        """``segment`` crossed its budget: the flight recorder's window decides (``flight_over``: a snapshot
        after the next call, then the older segment dropped), else a snapshot after the next call."""
        over = self.flight_over
        if over is None:
            self._flight_left = 0
            segment.budget = _NEVER
        else:
            over(segment)

    def _apply_flat(self) -> None:
        items, keys = self.flight_items, self.flight_keys
        try:
            method: str = items.popleft()
            req_id: str | None = items.popleft()
            outcome = items.popleft()
            count: int = items.popleft()
            flag: bool | None = items.popleft()
            taken = [keys.popleft() for _ in range(count)]
            segment = self.flight_segment
            if segment is not None and segment.add_flat(method, req_id, outcome, taken, flag):
                self._flight_over(segment)
        except Exception as exc:
            self.on_error("flight", exc)

    def _apply_lookup(self, key: bytes, req_id: str, result: object, now: float) -> None:
        if result is self.hit:
            self.promises.reported(req_id, key, self._code, now)
        elif result is self.hit_pending:
            self.promises.reported(req_id, key, self._code | 1, now)
        else:
            self.promises.not_reported(req_id, key)

    def _apply_load(self, keys: Any, req_id: str, result: Any) -> None:
        try:
            self.redeem(keys, req_id)
        except Exception as exc:  # the load still counts
            self.on_error("record.load", exc)
        self.mark_loaded(len(keys), result)

    def redeem(self, keys: Any, req_id: str) -> None:
        """A load's near misses, the one place they are redeemed, whether the load succeeded or not: into
        :attr:`near`, for the observer to settle."""
        broken = self.promises.redeemed(req_id, keys, self.recent, self._serial)
        if broken:
            self.near.append((req_id, broken))
            self._fold_first = True

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
        """Capture one removal batch (``path`` -1: from the frame, read now). ``unlisted``: a reset whose
        keys could not be listed, taken as a removal of every key. ``chunk_ids``: the removed chunks'
        slots, whose read bits say which were never loaded; None: none was (a store that failed)."""
        if not 0 <= reason < _NUM_REASONS:
            raise ValueError(f"bad reason code {reason}")
        if path < 0:
            path, req_id = self._where()
        self.capture((_REMOVAL, keys, reason, residency, now, path, req_id, unlisted, chunk_ids))

    def evicted(self, pairs: Sequence[tuple[bytes, Any]], now: float) -> None:
        """Capture a capacity removal batch as the policy returned it, ``[(key, chunk)]``: taken apart when
        applied (vLLM never changes the list or its chunks' ids after it returned them)."""
        path, req_id = self._where()
        residency = self.ages([chunk.chunk_id for _, chunk in pairs], now) if self.keep_residency else None
        self.capture((_EVICTED, pairs, now, path, req_id, residency))

    def _where(self) -> tuple[int, str | None]:
        """The path and request of a removal on this thread now (the running tap's frame)."""
        frame = self.frame
        if frame is not None and frame[2] == get_ident():
            req = frame[1]
            return frame[0], None if req is None else req.req_id
        # vLLM's tier-poll thread, or a thread kvobs does not know (kvobs.codes.POLL_THREAD_NAME)
        return _POLL_THREAD_PATH if current_thread().name == POLL_THREAD_NAME else _UNOBSERVED_PATH, None

    def _apply_removal(
        self,
        keys: list[bytes],
        reason: int,
        residency: Sequence[float] | None,
        now: float,
        path: int,
        req_id: str | None,
        unlisted: bool,
        chunk_ids: Sequence[int] | None,
    ) -> None:
        """Queue one captured removal batch: its serial, the recent-removals memory, the counts."""
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
            name = REASONS[reason]
            self.counts["evicted"][name] += n
            self.counts["batches"][name] += 1
            read = self._read
            if unlisted:
                read[:] = bytes(len(read))  # nothing to tell the chunks apart by: none counts as unread
            elif chunk_ids is None:
                self.counts["unread"][name] += n
            else:
                size = len(read) << 3
                unread = n
                for cid in chunk_ids:
                    if 0 <= cid < size:
                        bit = 1 << (cid & 7)
                        if read[cid >> 3] & bit:
                            read[cid >> 3] ^= bit
                            unread -= 1
                self.counts["unread"][name] += unread
            if len(queued) >= self._drain_keys or len(reqs) >= self._drain_batches:
                self._fold_first = True  # bounded: the observer folds the queue before the next capture
        finally:
            lock.release()

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

    def mark_loaded(self, count: int, result: Any) -> None:
        """A load of ``count`` chunks succeeded, answering ``result``: counted (every read, re-reads too), and each
        of its chunks' read bits set (the slots ``loaded_chunk_ids`` reads off the result, as vLLM handed them out).
        ``read_once``: a load that set a slot's read bit that was clear. Never more than the chunks written (a bit
        is cleared only by the removal of a written chunk), so read_once over written is a share
        (kvobs.codes.read_back_share)."""
        self.counts["loaded"][CPU_TIER] += count
        self.counts["loaded_bytes"][CPU_TIER] += count * self.chunk_bytes
        slots = self.loaded_chunk_ids
        if slots is None:
            return
        read = self._read
        size = len(read) << 3
        first = 0
        for cid in slots(result):
            if 0 <= cid < size:
                bit = 1 << (cid & 7)
                if not read[cid >> 3] & bit:
                    read[cid >> 3] |= bit
                    first += 1
        self.counts["read_once"][CPU_TIER] += first

    def stamp(self, chunk_id: int, now: float) -> None:
        """The chunk slot was filled now."""
        if 0 <= chunk_id < len(self._stamps):
            self._stamps[chunk_id] = now

    # -- the manager's taps (kvobs/hot_taps.py says what each records) -----------------

    def lookup_tap(
        self, inner: Callable[..., Any], *, path: int, hit: object, hit_pending: object, marks_frame: bool
    ) -> LookupTap:
        """A :class:`LookupTap` on ``inner``, whose HIT / HIT_PENDING answers are ``hit`` / ``hit_pending``."""
        self.hit = hit
        self.hit_pending = hit_pending
        return LookupTap(self, inner, path, marks_frame)

    def keys_tap(self, inner: Callable[..., Any], *, path: int, name: str) -> KeysTap:
        return KeysTap(self, inner, path, name)

    def store_tap(self, inner: Callable[..., Any], *, path: int) -> StoreTap:
        return StoreTap(self, inner, path)

    def request_tap(self, inner: Callable[..., Any], *, path: int) -> RequestTap:
        return RequestTap(self, inner, path)

    def call_tap(self, inner: Callable[..., Any], *, path: int, name: str) -> CallTap:
        return CallTap(self, inner, path, name)

    def pass_tap(self, inner: Callable[..., Any], *, name: str, shape: tuple[str, ...]) -> Any:
        """A call ``name`` only the flight recorder keeps, whose arguments are ``shape``
        (kvobs.vllm.compat.CALL_ARGS): ``on_new_request`` also makes its request live."""
        if name == "on_new_request":
            return NewRequestTap(self, inner)
        if shape == ("keys", "req"):
            return KeysPassTap(self, inner, name)
        return PassTap(self, inner, name)

    def load_tap(
        self,
        inner: Callable[..., Any],
        *,
        on_failure: Callable[[AssertionError, Any, Any], object],
    ) -> LoadTap:
        return LoadTap(self, inner, on_failure)
