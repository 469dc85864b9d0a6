"""The flight recorder: the last manager calls of an engine, from a snapshot of its state, for ``kvobs replay``.

The taps capture every manager call (kvobs/hot_taps.py, ``Recorder.call_captured``); kvobs's applier writes each,
once applied, into the current segment (kvobs.hot_captures.FlightSegment: columns, keys into a key table,
requests by id, answers by name; no Python object per call, so the garbage collector never walks a
window of a hundred thousand calls and no vLLM object but the keys stays alive). Every ``flight_calls``
calls the scheduler thread snapshots the manager's state between two calls (``Recorder.roll``; the
manager and its live requests, written as data by kvobs.vllm.compat.snapshot_state) and a new segment starts;
a window is the two latest segments, so it always starts at a state it can be replayed from: between
``flight_calls`` and twice as many calls.

Bounded: the segments' estimated memory (their snapshots, calls and keys; ``FlightSegment.nbytes``)
stays within ``flight_bytes``: a segment that outgrows its share asks for the next snapshot sooner, and a
snapshot that alone takes more than a quarter turns the recorder off (``off_reason`` says why, and so
does a bundle). Nothing here imports vLLM: what each argument of a call is comes from
kvobs.vllm.compat.CALL_ARGS.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from typing import Any

import msgspec

from kvobs.hot_path_loader import FlightSegment

ASK_AT = 0.8
"""A segment asks for the next snapshot at this share of its budget (kvobs.flight.FlightWindow.over)."""
Encoded = tuple[str, tuple[tuple[str, Any], ...], "bytes | None", Any]
"""A call in a bundle: its method; each argument as ``("k", i)`` (key ``i`` of the bundle's key table),
``("K", bytes)`` (the indices of several, ``array("I")`` bytes), ``("r", req_id)`` (a request),
``("v", value)`` (None, a bool, an int or a str) or ``("x", bytes)`` (anything else, written as data by
kvobs.vllm.compat.encode_value); its keywords, the same; and its answer (a lookup's result by name, whether a
store was accepted)."""


class FlightWindow:
    """The recorder's window: the segment since the last snapshot and the one before it
    (kvobs.hot_captures.FlightSegment, filled by the applier), the newest state a replay can start from.

    Installs each new segment on ``recorder`` (``flight_segment``) as its snapshot is applied, and turns the
    recorder off (``recorder.flight_off``) with a reason when a snapshot outgrows its share of ``max_bytes``.
    ``roles`` is kvobs.vllm.compat.CALL_ARGS, ``encode`` kvobs.vllm.compat.encode_value.
    """

    def __init__(self, recorder: Any, max_bytes: int, roles: dict[str, tuple[str, ...]],
                 encode: Callable[[Any], bytes]) -> None:
        self.recorder = recorder
        self.max_bytes = max_bytes
        self.roles = roles
        self.encode = encode
        self._older: Any = None
        self._current: Any = None
        self._asked: Any = None  # the segment that asked for the next snapshot already
        self.off_reason: str | None = None
        self.snapshots = 0

    def on_snapshot(self, state: bytes) -> None:
        """A snapshot was applied: the current segment becomes the older one, a new one starts from ``state``."""
        self.snapshots += 1
        if len(state) > self.max_bytes // 4:
            self.off(f"the manager's state snapshot takes {len(state)} bytes, over a quarter of flight_bytes "
                     f"({self.max_bytes})")
            return
        self._older = self._current
        share = self.max_bytes - (0 if self._older is None else self._older.nbytes)  # its state included
        self._current = FlightSegment(state, time.time(), self.roles, int(share * ASK_AT), self.encode)
        self.recorder.flight_segment = self._current
        self.recorder.flight_over = self.over

    def over(self, segment: Any) -> None:
        """The current segment crossed its budget (the applier calls this). The first time, a snapshot is asked
        for, after the next call: at ``ASK_AT`` of its share, so the calls captured before it arrives fit in the
        rest. If the two segments then outgrow ``max_bytes``, the older one goes (the window then starts at the
        current snapshot): they hold at most ``max_bytes`` but for calls applied while that snapshot is on its
        way."""
        if segment is not self._current:
            segment.budget = 1 << 62
            return
        if self._asked is not segment:
            self._asked = segment
            self.recorder.roll_soon()
        if self._older is not None and self._older.nbytes + segment.nbytes > self.max_bytes:
            self._older = None
        segment.budget = 1 << 62 if self._older is None else self.max_bytes - self._older.nbytes

    def off(self, reason: str) -> None:
        """Stop recording (and forget the window): ``reason`` says why, in every bundle from now."""
        self.off_reason = reason
        self.recorder.flight_off()
        self._older = self._current = None

    @property
    def calls(self) -> int:
        """Calls in the window now."""
        return sum(len(s) for s in (self._older, self._current) if s is not None)

    @property
    def nbytes(self) -> int:
        """The window's estimated memory: its calls, keys and the two snapshots."""
        return sum(s.nbytes for s in (self._older, self._current) if s is not None)

    def view(self, last: tuple[Any, ...] | None = None) -> list[tuple[Any, int, int]]:
        """The window as it is now, to decode later (:meth:`window`): each segment with the calls and keys it
        holds, and ``last`` (a capture of a call that did not return) as one more. Taken under the observer's
        drain lock, with every capture applied; segments only grow, so the lock is held for this and not
        for the decoding (which takes a quarter of a second for 66,000 calls)."""
        segments = [s for s in (self._older, self._current) if s is not None]
        if segments and last is not None:
            tail = FlightSegment(b"", 0.0, self.roles, 1 << 62, self.encode)
            tail.add(last)
            segments.append(tail)
        for segment in segments:
            segment.settle()  # every call held now in the columns the decoding reads
        return [(segment, len(segment), len(segment.keys)) for segment in segments]

    def window(self, view: list[tuple[Any, int, int]]) -> tuple[bytes | None, float, list[bytes], list[Encoded]]:
        """(the state the window starts from, when it was taken, the key table, the calls since, oldest first)
        of a :meth:`view`."""
        if not view:
            return None, 0.0, [], []
        keys: list[bytes] = []
        calls: list[Encoded] = []
        for segment, held, held_keys in view:
            calls.extend(self._decoded(segment, len(keys), held))
            keys.extend(bytes(k) for k in segment.keys[:held_keys])
        return view[0][0].state, view[0][0].taken, keys, calls

    def _decoded(self, segment: Any, offset: int, held: int) -> list[Encoded]:
        out: list[Encoded] = []
        start = 0
        extras_of = segment.extras_of(held)
        for i in range(held):  # the calls the segment held when viewed (the applier may append more meanwhile)
            method = segment.methods[i]
            end = segment.key_ends[i]
            refs = [r + offset for r in segment.key_refs[start:end]]
            start = end
            extras = dict(extras_of.get(i, ()))
            args: list[tuple[str, Any]] = []
            for position, role in enumerate(self.roles.get(method, ())):
                if role == "key":
                    args.append(("k", refs[0]))
                elif role == "keys":
                    args.append(("K", array("I", refs).tobytes()))
                elif role == "req":
                    args.append(("r", segment.req_ids[segment.reqs[i]]))
                elif position in extras:
                    value = extras[position]
                    args.append(("x", value) if isinstance(value, bytes) else ("v", value))
                else:
                    break  # the call was made without it (an optional argument)
            code = segment.outcomes[i]
            out.append((method, tuple(args), extras.get(-1), None if code < 0 else segment.outcome_values[code]))
        return out


def decode_indices(packed: bytes) -> list[int]:
    """The key indices a ``("K", bytes)`` argument holds."""
    out = array("I")
    out.frombytes(packed)
    return out.tolist()


class WindowCall(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A call in a bundle's window (:data:`Encoded`, field for field)."""

    method: str
    args: list[tuple[str, Any]]
    keywords: bytes | None
    answer: str | bool | None


class Window(msgspec.Struct, forbid_unknown_fields=True):
    """A bundle's window (kvobs/bundles.py ``WINDOW``): the state it starts from (kvobs.state_codec bytes), the
    key table and the calls since. MessagePack with this schema; values only, no pickle (SECURITY.md)."""

    state: bytes
    keys: list[bytes]
    calls: list[WindowCall]


def encode_window(state: bytes, keys: list[bytes], calls: list[Encoded]) -> bytes:
    """A window as a bundle stores it."""
    return msgspec.msgpack.encode(Window(state, keys, [WindowCall(m, list(a), k, r) for m, a, k, r in calls]))


def decode_window(blob: bytes) -> tuple[bytes, list[bytes], list[Encoded]]:
    """(state, keys, calls) of a stored window; ValueError naming what does not fit the schema. What each
    argument holds is checked where it is used (kvobs.vllm.bundle_replay)."""
    try:
        window = msgspec.msgpack.decode(blob, type=Window)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:  # nesting: RecursionError
        raise ValueError(f"the window is not a kvobs window: {exc}") from None
    return window.state, window.keys, [(c.method, tuple(c.args), c.keywords, c.answer) for c in window.calls]
