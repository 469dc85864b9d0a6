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

Capture, then apply (issue 33). On vLLM's scheduler thread a tap only calls vLLM and appends
what happened to a bounded buffer (``Recorder.captures``): the call's kind, its keys and request
id as references, its result, the time, appended flat (one ``deque.extend``, atomic under the GIL), so
that no object is made and kept per call: a tuple per capture that held vLLM's request context stayed
tracked by the garbage collector until applied, and the collections vLLM's own allocations trigger
walked thousands of them (issue 43; ``benchmarks/isolated.py`` measures it). The recording
itself (promises, the recent-removals memory, serials, near misses, the removal queue, the tier
counters' read bits) is done by
:meth:`Recorder.apply`, which takes captures in the order they were made, so it computes exactly
what recording inline computed. The observer applies (``Observer.drain``) on kvobs's applier
thread (kvobs/applier.py) every ``APPLY_EVERY_S`` or when ``CAPTURE_WAKE`` captures wait, on the
journal writer's wake, whenever anything reads the evidence, and first of all on a failed load,
before the diagnosis. A buffer at ``CAPTURE_LIMIT`` is applied by the thread that captures, then
and there (counted: ``kvobs_capture_buffer_full_total``): nothing is dropped, so nothing is
diagnosed from less than all of it (kvobs.codes, "the recorder's defaults").

Removal batches, once applied, are queued and folded by the observer into the history and the
sinks in bulk (``Recorder.take_run``).

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
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, NamedTuple

from kvobs.codes import (
    CAPACITY,
    CAPTURE_LIMIT,
    CAPTURE_WAKE,
    DEFERRED_RELEASE,
    DRAIN_BATCHES,
    DRAIN_KEYS,
    REASON_BITS,
    REASONS,
    RECENT_KEYS,
    RESET,
    STORE_FAILED,
)

monotonic: Final = time.monotonic  # Final: compiled, a static read, not a lookup in the module's dict
get_ident: Final = threading.get_ident
# Final, all of these: compiled, a constant is inlined and an object a static read, not a lookup in the
# module's dict on every use.
_UNKNOWN: Final = float("nan")
_NUM_REASONS: Final = len(REASONS)
_REASON_BITS: Final = REASON_BITS
_CAPACITY: Final = CAPACITY

# A capture is its kind followed by a fixed number of fields, all in one flat deque (Recorder.captures):
_LOOKUP: Final = 0  # _LOOKUP, key, request id, result, monotonic time
_LOAD: Final = 1  # _LOAD, keys, request id, result: a load that succeeded
_FINISH: Final = 2  # _FINISH, request id
_REMOVAL: Final = 3  # _REMOVAL, keys, reason, residency, time, path, req_id, unlisted, chunk_ids
_EVICTED: Final = 4  # _EVICTED, [(key, chunk)] as the policy returned it, time, path, req_id, residency
_CALL: Final = 5  # _CALL, method name, args, kwargs or None, outcome: a call only the flight recorder keeps
_SNAPSHOT: Final = 6  # _SNAPSHOT, state: the manager's state after every call captured before it
_FLAT: Final = 7  # _FLAT alone: a call only the flight recorder keeps, its parts in Recorder.flight_items
_FLAT_CAPTURE: Final = (_FLAT,)
_NEVER: Final = 1 << 62
_CALL_BYTES: Final = 24  # a call's columns (method reference, request, outcome, key end) and list growth
_REF_BYTES: Final = 6  # a key reference (an array item and its growth)
_KEY_BYTES: Final = 150  # a key or request id first seen in a segment: the object kept, its list and dict entries
# The capture kinds the flight recorder reads (kvobs/flight.py), under public names.
LOOKUP = _LOOKUP
LOAD = _LOAD
FINISH = _FINISH
CALL = _CALL
SNAPSHOT = _SNAPSHOT


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


class FlightSegment:
    """The manager calls since one snapshot (the flight recorder's, kvobs/flight.py), in columns.

    Call ``i`` is ``methods[i]`` of request ``req_ids[reqs[i]]`` (-1: none), answering
    ``outcome_values[outcomes[i]]`` (-1: nothing kept), with keys ``keys[key_refs[j]]`` for ``j`` from
    ``key_ends[i - 1]`` to ``key_ends[i]``, and any other argument in ``extras[i]`` (``(position, value)``
    pairs, a value other than None, a bool, an int or a str written as data by ``encode``; keywords at
    position -1, the same). No Python object per call: filled by kvobs's applier, the garbage collector never
    walks it, and it keeps no vLLM object alive but the keys. ``roles`` is kvobs.vllm.compat.CALL_ARGS,
    ``encode`` kvobs.vllm.compat.encode_value (no pickle: SECURITY.md).
    """

    def __init__(self, state: bytes, taken: float, roles: dict[str, tuple[str, ...]], budget: int,
                 encode: Callable[[Any], bytes]) -> None:
        self.state = state
        self._encode = encode
        self.taken = taken
        self.budget = budget
        self._roles = roles
        self.methods: list[str] = []
        self.reqs = array("i")
        self.outcomes = array("b")
        self.key_ends = array("I")
        self.key_refs = array("I")
        self.keys: list[bytes] = []
        self._key_index: dict[bytes, int] = {}
        self.req_ids: list[str] = []
        self._req_index: dict[str, int] = {}
        self.outcome_values: list[Any] = []
        self._outcome_codes: dict[Any, int] = {}
        self.extras: dict[int, list[tuple[int, Any]]] = {}
        self.nbytes = len(state)
        """Estimated bytes: the snapshot, ``_CALL_BYTES`` a call, ``_REF_BYTES`` a key reference,
        ``_KEY_BYTES`` a key or request first seen."""

    def __len__(self) -> int:
        return len(self.methods)

    def add(self, item: tuple[Any, ...]) -> bool:
        """Record the call a capture tuple, its kind then its fields, stands for (a failed load's, which
        kvobs.vllm.flight_recorder adds last); True once the segment is over its budget."""
        fields = (*item[1:], None, None, None, None)
        return self.add_fields(item[0], fields[0], fields[1], fields[2], fields[3])

    def add_fields(self, kind: int, first: Any, second: Any, third: Any, fourth: Any) -> bool:
        """Record an applied call from its capture's fields: ``_LOOKUP`` key, request id, result; ``_LOAD``
        keys, request id; ``_FINISH`` request id (second); ``_CALL`` name, args, kwargs, outcome. True once
        the segment is over its budget."""
        if kind == _LOOKUP:
            self._call("lookup", second, third)
            self._key(first)
        elif kind == _LOAD:
            self._call("prepare_load", second, True)
            for key in first:
                self._key(key)
        elif kind == _FINISH:
            self._call("on_request_finished", second, None)
        elif kind == _CALL:
            name: str = first
            args: tuple[Any, ...] = second
            roles = self._roles.get(name, ())
            req_id: str | None = None
            for position in range(len(args)):
                if position < len(roles) and roles[position] == "req":
                    req_id = args[position].req_id
            self._call(name, req_id, fourth)
            for position in range(len(args)):
                role = roles[position] if position < len(roles) else ""
                value = args[position]
                if role == "keys":
                    for key in value:
                        self._key(key)
                elif role == "key":
                    self._key(value)
                elif role != "req":
                    self._extra(position, value)
            if third:
                self._extra(-1, dict(third))
        else:
            return False
        self.key_ends.append(len(self.key_refs))
        return self.nbytes > self.budget

    def add_flat(self, method: str, req_id: str | None, outcome: Any, keys: list[bytes]) -> bool:
        """Record a call captured flat (``Recorder.flight_captured``); True once over the budget."""
        self._call(method, req_id, outcome)
        for key in keys:
            self._key(key)
        self.key_ends.append(len(self.key_refs))
        return self.nbytes > self.budget

    def _call(self, method: str, req_id: str | None, outcome: Any) -> None:
        self.methods.append(method)
        if req_id is None:
            self.reqs.append(-1)
        else:
            index = self._req_index.get(req_id)
            if index is None:
                index = self._req_index[req_id] = len(self.req_ids)
                self.req_ids.append(req_id)
                self.nbytes += _KEY_BYTES
            self.reqs.append(index)
        if outcome is None:
            self.outcomes.append(-1)
        else:
            code = self._outcome_codes.get(outcome)
            if code is None:
                code = self._outcome_codes[outcome] = len(self.outcome_values)
                self.outcome_values.append(outcome if isinstance(outcome, (bool, str))
                                           else str(outcome))
            self.outcomes.append(code)
        self.nbytes += _CALL_BYTES

    def _key(self, key: bytes) -> None:
        index = self._key_index.get(key)
        if index is None:
            index = self._key_index[key] = len(self.keys)
            self.keys.append(key)
            self.nbytes += _KEY_BYTES
        self.key_refs.append(index)
        self.nbytes += _REF_BYTES

    def _extra(self, position: int, value: Any) -> None:
        if not (value is None or isinstance(value, (bool, int, str))):
            value = self._encode(value)
            self.nbytes += len(value)
        index = len(self.methods) - 1
        found = self.extras.get(index)
        if found is None:
            self.extras[index] = [(position, value)]
        else:
            found.append((position, value))
        self.nbytes += _CALL_BYTES


class Recorder:
    """Taps, the capture buffer, the promise table and the removal queue of one observed manager.

    ``on_full()`` is called (outside any lock) when the removal queue asks to be drained;
    ``on_apply()`` applies every capture now (the observer's drain; by default :meth:`apply_all`);
    ``on_backlog()`` asks for an apply soon (kvobs's applier thread), once each time
    ``capture_wake`` captures wait; ``on_near(req_id, redeemed)`` hears a load's broken promises;
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
        on_near: Callable[[str, list[tuple[bytes, Verdict, bool]]], object] | None = None,
        on_apply: Callable[[], None] | None = None,
        on_backlog: Callable[[], None] | None = None,
        recent_keys: int = RECENT_KEYS,
        drain_keys: int = DRAIN_KEYS,
        drain_batches: int = DRAIN_BATCHES,
        capture_wake: int = CAPTURE_WAKE,
        capture_limit: int = CAPTURE_LIMIT,
    ) -> None:
        self.promises = Promises(max_verdicts)
        self.recent = RecentRemovals(recent_keys)
        self.on_error = on_error
        self._on_full = on_full
        self._off_thread_path = off_thread_path
        self._on_near = on_near
        self._on_apply = on_apply
        self._on_backlog = on_backlog
        self._drain_keys = drain_keys
        self._drain_batches = drain_batches
        # Flat: each capture is its kind and then its fields (the ``_LOOKUP``... table above), added by one
        # extend, which no other thread's append can split; popleft() by the applier never loses one.
        self.captures: deque[Any] = deque()
        self._extend: Callable[[tuple[Any, ...]], None] = self.captures.extend  # read once: compiled, a lookup a call
        self._made = 0  # captures made (on vLLM's threads)
        self._applied = 0  # captures applied (one thread at a time: the observer's drain lock)
        # A call only the flight recorder keeps is captured flat: its method, request id, outcome and key count
        # here, its keys in ``flight_keys``, and ``_FLAT`` alone in ``captures`` to keep its place. No object is
        # made or kept alive per call, so none has to be collected (docs/performance.md, issue 32).
        self.flight_items: deque[Any] = deque()
        self.flight_keys: deque[bytes] = deque()
        self._capture_wake = max(1, capture_wake)
        self._capture_limit = max(self._capture_wake, capture_limit)
        self.captures_full = 0
        """Times a capture found the buffer at its limit and applied it there (nothing is dropped)."""
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
        self._evicted = [0] * len(REASONS)
        self._batches = [0] * len(REASONS)
        self._unread = [0] * len(REASONS)
        self.stored = 0
        """Chunks the CPU tier took to store (``prepare_store``'s ``keys_to_store``)."""
        self.loaded = 0
        """Chunks loaded from the CPU tier (``prepare_load`` calls that succeeded): every read, re-reads too."""
        self.promoted = 0
        """Chunks a tiering manager wrote into the CPU tier from a lower tier (its CPU tier's ``prepare_write``
        took them: :class:`WriteTap`). Written chunks = ``stored`` + ``promoted``."""
        self.read_once = 0
        """Chunks read at least once since written: a load that set a slot's read bit that was clear. Never more
        than the chunks written (a bit is cleared only by the removal of a written chunk), so read_once over
        written is a share (kvobs.codes.read_back_share)."""
        # A bit per CPU-tier slot: set when its chunk is loaded, cleared when the chunk is removed, so a
        # removal tells a chunk never read since its store (issue 29: "is the tier doing anything").
        self._read = bytearray((max(0, num_stamps) + 7) >> 3)
        self.loaded_chunk_ids: Callable[[Any], Any] | None = None
        """The CPU-tier slots a successful load's result names (kvobs.vllm.compat.loaded_chunk_ids), set when
        the policy is hooked; None: loads are counted, no read bit is set."""
        # Which tapped call is running: (path code, request context, thread id), or None.
        self.frame: tuple[int, Any, int] | None = None
        # The flight recorder (kvobs/flight.py), off until flight_on(): applied calls go to ``flight_segment``,
        # snapshots to ``flight``; every ``_flight_segment`` calls the scheduler thread snapshots the manager's
        # state (``_snapshot``).
        self.flight: Callable[[bytes], None] | None = None
        self.flight_segment: FlightSegment | None = None
        self.flight_over: Callable[[FlightSegment], None] | None = None
        """Called (applier side) when ``flight_segment`` crosses its budget (kvobs.flight.FlightWindow.over)."""
        self.flight_calls = False
        """Whether the taps capture the calls only the flight recorder needs (a store, a completion...)."""
        self._snapshot: Callable[[], bytes | None] | None = None
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
        self._made += 1
        waiting = self._made - self._applied
        if waiting >= self._capture_wake:
            self._backlogged(waiting)

    def call_captured(self, fields: tuple[Any, ...]) -> None:
        """Capture a manager call that just returned (a boundary between calls: where the flight
        recorder may snapshot the manager's state)."""
        self.capture(fields)
        self._flight_left -= 1
        if self._flight_left <= 0:
            self.roll()

    def flight_captured(self, method: str, keys: Any, req_context: Any, outcome: Any) -> None:
        """Capture, flat, a call only the flight recorder keeps: ``method(keys, ...)`` of the request
        ``req_context`` names (``keys`` None: it took none) that answered ``outcome``. Never raises: the request
        id is read here, inside the guard, so a context kvobs does not know turns the recorder off, not vLLM's
        call into an exception."""
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
        except Exception as exc:
            self.on_error("flight", exc)
            self.flight_off()
            return
        self.call_captured(_FLAT_CAPTURE)

    def flight_on(self, on_snapshot: Callable[[bytes], None], snapshot: Callable[[], bytes | None],
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
            self.captures_full += 1
            self.apply_now("record.removal")
        elif waiting == self._capture_wake and self._on_backlog is not None:
            try:
                self._on_backlog()
            except Exception as exc:
                self.on_error("record.removal", exc)

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
        recording inline did. A capture that faults is counted under its stage and skipped."""
        pop = self.captures.popleft
        done = 0
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
            elif kind == _REMOVAL:
                keys, reason, residency, now = pop(), pop(), pop(), pop()
                path, req_id, unlisted, chunk_ids = pop(), pop(), pop(), pop()
                try:
                    self._apply_removal(keys, reason, residency, now, path, req_id, unlisted, chunk_ids)
                except Exception as exc:
                    self.on_error("record.removal", exc)
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
            taken = [keys.popleft() for _ in range(count)]
            segment = self.flight_segment
            if segment is not None and segment.add_flat(method, req_id, outcome, taken):
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
        """A load's near misses, the one place they are redeemed, whether the load succeeded or not."""
        broken = self.promises.redeemed(req_id, keys, self.recent, self._serial)
        if broken and self._on_near is not None:
            self._on_near(req_id, broken)

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
        return self._off_thread_path(), None

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

    def mark_loaded(self, count: int, result: Any) -> None:
        """A load of ``count`` chunks succeeded, answering ``result``: counted, and each of its chunks'
        read bits set (the slots ``loaded_chunk_ids`` reads off the result, as vLLM handed them out)."""
        self.loaded += count
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
        self.read_once += first

    def stamp(self, chunk_id: int, now: float) -> None:
        """The chunk slot was filled now."""
        if 0 <= chunk_id < len(self._stamps):
            self._stamps[chunk_id] = now

    # -- the manager's taps -------------------------------------------------------------

    def lookup_tap(
        self, inner: Callable[..., Any], *, path: int, hit: object, hit_pending: object, marks_frame: bool
    ) -> LookupTap:
        """``lookup(key, req_context, **kw)``: captured; applied, a promise per HIT / HIT_PENDING, a void
        per other answer.

        ``marks_frame``: the lookup can remove chunks (tiering promotions), so removals
        under it are attributed to it.
        """
        self.hit = hit
        self.hit_pending = hit_pending
        return LookupTap(self, inner, path, marks_frame)

    def keys_tap(self, inner: Callable[..., Any], *, path: int, name: str) -> KeysTap:
        """``name(keys, req_context, ...)`` (``complete_store``): removals under it are attributed to ``path``
        and the request."""
        return KeysTap(self, inner, path, name)

    def store_tap(self, inner: Callable[..., Any], *, path: int) -> StoreTap:
        """``prepare_store(keys, req_context)``: as :meth:`keys_tap`, and counts the chunks it took to store."""
        return StoreTap(self, inner, path)

    def request_tap(self, inner: Callable[..., Any], *, path: int) -> RequestTap:
        """``on_request_finished(req_context, **kw)``: removals under it attributed; then (captured) the request
        is gone."""
        return RequestTap(self, inner, path)

    def call_tap(self, inner: Callable[..., Any], *, path: int, name: str) -> CallTap:
        """Any other call ``name`` that can remove chunks (``on_schedule_end``, ``reset_cache``): attributed to
        ``path``."""
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
        """``prepare_load(keys, req_context)``: on success captured (applied: the recorder's ``on_near``
        hears its near misses and the promises left to the history, and its chunks count as loaded);
        on vLLM's assertion, every capture is applied first, then its near misses, then ``on_failure``.

        ``on_failure(exc, keys, req_context)`` runs before the assertion propagates (it appends
        the explanation to the same exception object); the assertion then leaves unchanged otherwise.
        What it returns decides: None, the assertion goes on (always, unless survive mode is on);
        anything else is returned instead (survive mode's load source, kvobs/vllm/survive.py).
        """
        return LoadTap(self, inner, on_failure)


# The taps are classes with vLLM's own parameter names, not ``*args, **kwargs`` closures: compiled,
# a call then costs about 20 ns instead of 80-130 (docs/performance.md). An optional parameter
# (``exclude_tier_idx``, ``success``) is forwarded only when the caller gave it, so the inner method
# sees exactly what the caller passed and raises what it would raise; kvobs.vllm.compat checks that
# vLLM's methods take these parameters.

_ABSENT: Final[Any] = object()


class LookupTap:
    def __init__(self, rec: Recorder, inner: Callable[..., Any], path: int, marks_frame: bool) -> None:
        self.rec = rec
        self.inner = inner
        self.path = path
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
            req_id = req_context.req_id
        except Exception as exc:  # not a request context kvobs knows: nothing to capture, vLLM's answer stands
            rec.on_error("record.lookup", exc)
            return result
        rec.call_captured((_LOOKUP, key, req_id, result, monotonic()))
        return result


class KeysTap:
    def __init__(self, rec: Recorder, inner: Callable[..., Any], path: int, name: str) -> None:
        self.rec = rec
        self.inner = inner
        self.path = path
        self.name = name

    def __call__(self, keys: Any, req_context: Any, success: Any = _ABSENT) -> Any:
        rec = self.rec
        before = rec.frame
        rec.frame = (self.path, req_context, get_ident())
        try:
            result = self.inner(keys, req_context) if success is _ABSENT else self.inner(keys, req_context, success)
        finally:
            rec.frame = before
        if rec.flight_calls:
            if success is _ABSENT:
                rec.flight_captured(self.name, keys, req_context, None)
            else:
                rec.call_captured((_CALL, self.name, (keys, req_context, success), None, None))
        return result


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
        if rec.flight_calls:
            rec.flight_captured("prepare_store", keys, req_context, result is not None)
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
            req_id = req_context.req_id
        except Exception as exc:
            rec.on_error("record.finish", exc)
            return result
        if rec.flight_calls:
            rec.flight_live.pop(req_id, None)
        rec.call_captured((_FINISH, req_id))
        return result


class CallTap:
    def __init__(self, rec: Recorder, inner: Callable[..., Any], path: int, name: str) -> None:
        self.rec = rec
        self.inner = inner
        self.path = path
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        rec = self.rec
        before = rec.frame
        rec.frame = (self.path, None, get_ident())
        try:
            result = self.inner(*args, **kwargs)
        finally:
            rec.frame = before
        if rec.flight_calls:
            rec.call_captured((_CALL, self.name, args, kwargs or None, None))
        return result


class NewRequestTap:
    """``on_new_request(req_context)`` while the flight recorder is on: the request is live (``flight_live``)."""

    def __init__(self, rec: Recorder, inner: Callable[..., Any]) -> None:
        self.rec = rec
        self.inner = inner

    def __call__(self, req_context: Any) -> Any:
        result = self.inner(req_context)
        rec = self.rec
        if rec.flight_calls:
            try:
                req_id = req_context.req_id
            except Exception as exc:
                rec.on_error("flight", exc)
                rec.flight_off()
                return result
            live = rec.flight_live
            if len(live) >= rec.flight_live_limit and req_id not in live:
                del live[next(iter(live))]
            live[req_id] = req_context
            rec.flight_captured("on_new_request", None, req_context, None)
        return result


class KeysPassTap:
    """``name(keys, req_context)`` (``complete_load``, ``touch``) while the flight recorder is on."""

    def __init__(self, rec: Recorder, inner: Callable[..., Any], name: str) -> None:
        self.rec = rec
        self.inner = inner
        self.name = name

    def __call__(self, keys: Any, req_context: Any) -> Any:
        result = self.inner(keys, req_context)
        rec = self.rec
        if rec.flight_calls:
            rec.flight_captured(self.name, keys, req_context, None)
        return result


class PassTap:
    """A call kvobs records nothing about but the flight recorder keeps (``complete_load``,
    ``on_new_request``...): set only while the flight recorder is on."""

    def __init__(self, rec: Recorder, inner: Callable[..., Any], name: str) -> None:
        self.rec = rec
        self.inner = inner
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self.inner(*args, **kwargs)
        rec = self.rec
        if rec.flight_calls:
            rec.call_captured((_CALL, self.name, args, kwargs or None, None))
        return result


class WriteTap:
    """A tiering manager's CPU tier's ``prepare_write(keys, req_context)`` (vLLM's ``prepare_store`` under the
    name its promotions call): counts the chunks it took as ``promoted``, an int added on vLLM's thread, no
    object made (kvobs.vllm.compat.PROMOTION_WRITE)."""

    def __init__(self, rec: Recorder, inner: Callable[..., Any]) -> None:
        self.rec = rec
        self.inner = inner

    def __call__(self, keys: Any, req_context: Any) -> Any:
        result = self.inner(keys, req_context)
        if result is not None:
            rec = self.rec
            try:
                rec.promoted += len(result.keys_to_store)  # kvobs.vllm.compat.STORED_FIELD
            except Exception as exc:
                rec.on_error("record.store", exc)
        return result

    def __reduce__(self) -> Any:
        return self.inner.__reduce__()

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return copy.deepcopy(self.inner, memo)


class LoadTap:
    def __init__(
        self, rec: Recorder, inner: Callable[..., Any], on_failure: Callable[[AssertionError, Any, Any], object]
    ) -> None:
        self.rec = rec
        self.inner = inner
        self.on_failure = on_failure

    def __call__(self, keys: Any, req_context: Any) -> Any:
        try:
            result = self.inner(keys, req_context)
        except AssertionError as exc:
            rec = self.rec
            rec.apply_now("diagnosis")  # the diagnosis reads the evidence of every call before this one
            try:
                rec.redeem(keys, req_context.req_id)  # before the diagnosis, which counts these near misses too
            except Exception as fault:
                rec.on_error("record.load", fault)
            instead: object = None
            try:
                instead = self.on_failure(exc, keys, req_context)
            except Exception as fault:
                rec.on_error("diagnosis", fault)
            if instead is None:
                raise
            return instead  # survive mode's decision, made once, in the failure callback
        rec = self.rec
        try:
            req_id = req_context.req_id
        except Exception as exc:
            rec.on_error("record.load", exc)
            return result
        rec.call_captured((_LOAD, keys, req_id, result))
        return result


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
                rec.evicted(evicted, monotonic())
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
