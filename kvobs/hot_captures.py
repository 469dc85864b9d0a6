"""What a capture is (its kinds, below), and the flight recorder's segment that applied captures go into.

Capture, then apply (issue 33). On vLLM's scheduler thread a tap only calls vLLM and appends what happened to a
bounded buffer (``Recorder.captures``): the call's kind, its keys and request id as references, its result, the
time, appended flat (one call into the capture ring, kvobs/capture_ring.py, atomic under the GIL: in C, nothing
allocated for it), so that no object is made and kept per call: a tuple per capture that held vLLM's request
context stayed tracked by the garbage collector until applied, and the collections vLLM's own allocations
trigger walked thousands of them (issue 43; ``benchmarks/isolated.py`` measures it). The recording itself
(promises by the rule in kvobs/hot_promises.py, the recent-removals memory, serials, near misses, the removal
queue, the tier counters' read bits) is done by :meth:`Recorder.apply`, which takes captures in the order they
were made, so it computes exactly what recording inline computed. The observer applies (``Observer.drain``) on
kvobs's applier thread (kvobs/applier.py) every ``APPLY_EVERY_S`` or when ``CAPTURE_WAKE`` captures wait, on the
journal writer's wake, whenever anything reads the evidence, and on a failed load once, on the failing thread,
before the diagnosis reads (the failed load is itself captured: its near misses are redeemed in order). A buffer
at ``CAPTURE_LIMIT`` is applied by the thread that captures, then and there (counted:
``kvobs_capture_buffer_full_total``): nothing is dropped, so nothing is diagnosed from less than all of it
(kvobs.codes, "the recorder's defaults"). Removal batches, once applied, are queued and folded by the observer
into the history and the sinks in bulk (``Recorder.take_run``).

:class:`FlightSegment` keeps the applied calls since one snapshot, in columns, for the flight recorder
(kvobs/flight.py). Part of the hot path (kvobs/hot_path_modules.py): compiled with it, loaded with it.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any, Final

# Final, all of these: compiled, a constant is inlined (in the other hot-path modules too), not a lookup in
# the module's dict on every use.
# A capture is its kind followed by a fixed number of fields, all in one flat ring (Recorder.captures):
_LOOKUP: Final = 0  # _LOOKUP, key, request id, result, monotonic time
_LOAD: Final = 1  # _LOAD, keys, request id, result: a load that succeeded
_FINISH: Final = 2  # _FINISH, request id
_REMOVAL: Final = 3  # _REMOVAL, keys, reason, residency, time, path, req_id, unlisted, chunk_ids
_EVICTED: Final = 4  # _EVICTED, [(key, chunk)] as the policy returned it, time, path, req_id, residency
_CALL: Final = 5  # _CALL, method name, args, kwargs or None, outcome: a call only the flight recorder keeps
_SNAPSHOT: Final = 6  # _SNAPSHOT, state: the manager's state after every call captured before it
_FLAT: Final = 7  # _FLAT alone: a call only the flight recorder keeps, its parts in Recorder.flight_items
_FAILED_LOAD: Final = 8  # _FAILED_LOAD, keys, request id: a load vLLM's assertion failed (its promises redeemed)
_STORED: Final = 9  # _STORED, chunks: what a prepare_store's keys_to_store took into the CPU tier (StoreTap)
_PROMOTED: Final = 10  # _PROMOTED, chunks: what a promotion wrote into the CPU tier (WriteTap)
_CALL_BYTES: Final = 24  # a call's columns (method reference, request, outcome, key end) and list growth
_REF_BYTES: Final = 6  # a key reference (an array item and its growth)
_KEY_BYTES: Final = 150  # a key or request id first seen in a segment: the object kept, its list and dict entries
_SETTLE_CALLS: Final = 1024  # calls a segment's integer columns take in lists before they move into its arrays
# The capture kinds the flight recorder reads (kvobs/flight.py), under public names.
LOOKUP = _LOOKUP
LOAD = _LOAD
FINISH = _FINISH
CALL = _CALL
SNAPSHOT = _SNAPSHOT


class FlightSegment:
    """The manager calls since one snapshot (the flight recorder's, kvobs/flight.py), in columns.

    Call ``i`` is ``methods[i]`` of request ``req_ids[reqs[i]]`` (-1: none), answering
    ``outcome_values[outcomes[i]]`` (-1: nothing kept), with keys ``keys[key_refs[j]]`` for ``j`` from
    ``key_ends[i - 1]`` to ``key_ends[i]``, and any other argument in the ``extra_`` columns (:meth:`extras_of`:
    ``(position, value)`` pairs, a value other than None, a bool, an int or a str written as data by
    ``encode``; keywords at position -1, the same). No Python object per call: filled by kvobs's applier, the
    garbage collector never walks it, and it keeps no vLLM object alive but the keys. The integer columns take
    each call in a short list first (a list's append is a C call from compiled code, an array's a method call:
    about a third of a call's cost) and move into their arrays every ``_SETTLE_CALLS`` calls and at
    :meth:`settle`, which a reader calls first (kvobs.flight.FlightWindow.view, under the drain lock). ``roles`` is
    kvobs.vllm.compat.CALL_ARGS, ``encode`` kvobs.vllm.compat.encode_value (no pickle: SECURITY.md).
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
        # By identity: an answer is one of a few objects (vLLM's LookupResult members, True, False), and an enum
        # member's hash is a Python call. ``_outcome_objects`` keeps each alive, so no id is reused meanwhile.
        self._outcome_codes: dict[int, int] = {}
        self._outcome_objects: list[Any] = []
        # Any other argument, in three columns (no object per call): call ``extra_calls[j]``'s argument at
        # position ``extra_positions[j]`` is ``extra_values[j]`` (None, a bool, an int, a str or ``encode``'s bytes).
        self.extra_calls = array("I")
        self.extra_positions = array("b")
        self.extra_values: list[Any] = []
        # The columns' newest entries, not yet settled (at most _SETTLE_CALLS calls' worth).
        self._reqs_tail: list[int] = []
        self._outcomes_tail: list[int] = []
        self._key_ends_tail: list[int] = []
        self._key_refs_tail: list[int] = []
        self._extra_calls_tail: list[int] = []
        self._extra_positions_tail: list[int] = []
        self._refs = 0  # key references, settled or not
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
        return self._ended()

    def add_flat(self, method: str, req_id: str | None, outcome: Any, keys: list[bytes], flag: bool | None) -> bool:
        """Record a call captured flat (``Recorder.flight_captured``; ``flag``, unless None, its third
        argument); True once over the budget."""
        self._call(method, req_id, outcome)
        for key in keys:
            self._key(key)
        if flag is not None:
            self._extra(2, flag)
        return self._ended()

    def _ended(self) -> bool:
        """A call's last column written; True once the segment is over its budget."""
        ends = self._key_ends_tail
        ends.append(self._refs)
        if len(ends) >= _SETTLE_CALLS:
            self.settle()
        return self.nbytes > self.budget

    def settle(self) -> None:
        """Every call so far into the array columns (a reader's first step; one thread at a time with the
        applier: the observer's drain lock)."""
        for column, tail in ((self.reqs, self._reqs_tail), (self.outcomes, self._outcomes_tail),
                             (self.key_ends, self._key_ends_tail), (self.key_refs, self._key_refs_tail),
                             (self.extra_calls, self._extra_calls_tail),
                             (self.extra_positions, self._extra_positions_tail)):
            if tail:
                column.fromlist(tail)
                tail.clear()

    def _call(self, method: str, req_id: str | None, outcome: Any) -> None:
        self.methods.append(method)
        if req_id is None:
            self._reqs_tail.append(-1)
        else:
            index = self._req_index.get(req_id)
            if index is None:
                index = self._req_index[req_id] = len(self.req_ids)
                self.req_ids.append(req_id)
                self.nbytes += _KEY_BYTES
            self._reqs_tail.append(index)
        if outcome is None:
            self._outcomes_tail.append(-1)
        else:
            code = self._outcome_codes.get(id(outcome))
            if code is None:
                code = self._outcome_codes[id(outcome)] = len(self.outcome_values)
                self._outcome_objects.append(outcome)
                self.outcome_values.append(outcome if isinstance(outcome, (bool, str))
                                           else str(outcome))
                self.nbytes += _KEY_BYTES
            self._outcomes_tail.append(code)
        self.nbytes += _CALL_BYTES

    def _key(self, key: bytes) -> None:
        index = self._key_index.get(key)
        if index is None:
            index = self._key_index[key] = len(self.keys)
            self.keys.append(key)
            self.nbytes += _KEY_BYTES
        self._key_refs_tail.append(index)
        self._refs += 1
        self.nbytes += _REF_BYTES

    def _extra(self, position: int, value: Any) -> None:
        if not (value is None or isinstance(value, (bool, int, str))):
            value = self._encode(value)
            self.nbytes += len(value)
        self._extra_calls_tail.append(len(self.methods) - 1)
        self._extra_positions_tail.append(position)
        self.extra_values.append(value)
        self.nbytes += _CALL_BYTES

    def extras_of(self, held: int) -> dict[int, list[tuple[int, Any]]]:
        """The other arguments of the first ``held`` calls: ``(position, value)`` pairs by call (for a bundle:
        kvobs.flight.FlightWindow; settled first)."""
        out: dict[int, list[tuple[int, Any]]] = {}
        for i in range(len(self.extra_calls)):
            call = self.extra_calls[i]
            if call >= held:
                break
            out.setdefault(call, []).append((self.extra_positions[i], self.extra_values[i]))
        return out
