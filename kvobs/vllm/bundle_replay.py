"""``kvobs replay BUNDLE``: vLLM's real manager rebuilt from a bundle's snapshot, its recorded calls made again.

A bundle (kvobs/flight.py, written by kvobs.vllm.flight_recorder) holds the manager's state at the start
of its window, as values (kvobs.state_codec), and every call since. Replaying rebuilds vLLM's manager from
those values with the installed vLLM (the bundle's release is required: another release's classes hold
other attributes), makes each call on the bare manager (kvobs is not involved) and says whether vLLM's own
assertion happens at the same call with the same text. ``minimize`` shrinks the calls by delta debugging
(Zeller's ddmin) to the fewest that still fail the same way; ``emit_test`` writes them as a standalone
pytest file that needs vLLM alone.

A bundle is data (SECURITY.md): nothing in it is unpickled, imported or evaluated. Its state can only hold
objects of the classes kvobs.vllm.compat.snapshot_table lists, its calls only the manager methods the flight
recorder records (kvobs.vllm.compat.CALL_ARGS) with arguments of the kinds each takes; anything else is
refused with ReplayError before a call is made.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.kv_offload.base import ReqContext

from kvobs.bundles import read_header, read_window
from kvobs.flight import Encoded, decode_indices, decode_window
from kvobs.options import flight_bytes_range
from kvobs.vllm import compat
from kvobs.vllm.flight_recorder import FAILED


class ReplayError(Exception):
    """The bundle cannot be replayed here; the message says why."""


@dataclass
class Bundle:
    path: str
    header: dict[str, Any]
    state: bytes
    keys: list[bytes]
    calls: list[Encoded]

    @property
    def failure(self) -> dict[str, Any] | None:
        failure = self.header.get("failure")
        return failure if isinstance(failure, dict) else None


def load(path: str) -> Bundle:
    """Read a bundle and check every call in it; ReplayError (naming why) when it cannot be replayed with the
    installed vLLM, whatever the file holds."""
    try:
        header = read_header(path)
    except ValueError as exc:
        raise ReplayError(str(exc)) from None
    window = header.get("window")
    window = window if isinstance(window, dict) else {}
    if window.get("replayable") is not True:
        raise ReplayError(f"{path}: the bundle holds no window to replay: {window.get('why_not') or 'no reason given'}")
    recorded = header.get("vllm_version")
    if recorded != compat.VLLM_VERSION:
        raise ReplayError(f"{path} was recorded on vLLM {recorded!r}; this Python has vLLM {compat.VLLM_VERSION}: "
                          f"replay it with vLLM {recorded!r} installed (its state holds that release's attributes)")
    options = header.get("options")
    limit = options.get("flight_bytes") if isinstance(options, dict) else None
    low, high = flight_bytes_range()
    if type(limit) is not int or not low <= limit <= high:
        raise ReplayError(f"{path}: the header's options.flight_bytes {limit!r} is not within {low}-{high}")
    try:
        state, keys, calls = decode_window(read_window(path, limit))
    except ValueError as exc:
        raise ReplayError(f"{path}: {exc}") from None
    failure = header.get("failure")
    if failure is not None and not (isinstance(failure, dict) and calls
                                    and calls[-1][0] == failure.get("method", "prepare_load")):
        raise ReplayError(f"{path}: the failure is not the call the window ends with")
    for index, call in enumerate(calls):
        problem = _check_call(call, len(keys))
        if problem is not None:
            raise ReplayError(f"{path}: call {index + 1}: {problem}")
    return Bundle(path, header, state, keys, calls)


_PLAIN = (type(None), bool, int, str)


def _check_call(call: Encoded, nkeys: int) -> str | None:
    """What is wrong with a window's call (None: nothing): a method the recorder records, each argument of the
    kind the method takes there, keywords the method takes."""
    method, args, keywords, _ = call
    roles = compat.CALL_ARGS.get(method)
    if roles is None:
        return f"{method!r} is not a manager call a bundle may hold"
    required = max((i + 1 for i, role in enumerate(roles) if role), default=0)  # keys and requests always
    if not required <= len(args) <= len(roles):
        return f"{method} takes {required}-{len(roles)} recorded arguments, the bundle gives {len(args)}"
    for (tag, value), role in zip(args, roles, strict=False):
        if role == "key":
            ok = tag == "k" and type(value) is int and 0 <= value < nkeys
        elif role == "keys":
            ok = tag == "K" and type(value) is bytes and len(value) % 4 == 0 \
                and all(i < nkeys for i in decode_indices(value))
        elif role == "req":
            ok = tag == "r" and type(value) is str
        elif tag == "x" and type(value) is bytes:
            try:
                compat.decode_value(value)
            except ValueError as exc:
                return f"{method}'s argument: {exc}"
            ok = True
        else:
            ok = tag == "v" and type(value) in _PLAIN
        if not ok:
            return f"{method}'s {role or 'value'} argument is {tag!r}: {type(value).__name__}, not one"
    if keywords is not None:
        allowed = compat.PROTOCOL_BY_NAME[method].keywords
        try:
            decoded = compat.decode_value(keywords)
        except ValueError as exc:
            return f"{method}'s keywords: {exc}"
        if not isinstance(decoded, dict) or not all(k in allowed for k in decoded):
            return f"{method}'s keywords are not among {list(allowed)}"
    return None


@dataclass
class Outcome:
    """What a replay did: ``raised_at`` the index of the call that raised (None: none did), with vLLM's text;
    ``diverged``: calls whose answer differs from the recording (index, what)."""

    calls: int
    raised_at: int | None = None
    exception: str | None = None
    message: str | None = None
    diverged: list[tuple[int, str]] = field(default_factory=list)

    def reproduces(self, bundle: Bundle) -> bool:
        """vLLM's own exception, of the recorded type (an assertion for a failed load) and text, at the last
        call (the one that failed)."""
        failure = bundle.failure
        return (failure is not None and self.raised_at == self.calls - 1
                and self.exception == failure.get("exception_type", FAILED)
                and self.message == failure.get("vllm_message"))


def replay(bundle: Bundle, indices: Sequence[int] | None = None) -> Outcome:
    """Make the bundle's calls (``indices`` of them, in order; all by default) on a manager rebuilt from its
    snapshot; stop at the first exception. ReplayError when the snapshot does not rebuild."""
    try:
        manager, contexts = compat.rebuild_state(bundle.state)
    except ValueError as exc:
        raise ReplayError(f"{bundle.path}: {exc}") from None
    chosen = range(len(bundle.calls)) if indices is None else indices
    outcome = Outcome(calls=len(chosen))
    for position, index in enumerate(chosen):
        method, args, kwargs, recorded = bundle.calls[index]
        real = [_decode(arg, bundle.keys, contexts) for arg in args]
        try:
            result = getattr(manager, method)(*real, **({} if kwargs is None else compat.decode_value(kwargs)))
        except Exception as exc:
            outcome.raised_at, outcome.exception, outcome.message = position, type(exc).__name__, str(exc)
            return outcome
        answer = str(result) if method == "lookup" else result is not None if method == "prepare_store" else True
        if recorded is not None and recorded != FAILED and answer != recorded:
            outcome.diverged.append((position, f"{method} answered {answer!r}, recorded {recorded!r}"))
    return outcome


def _decode(arg: tuple[str, Any], keys: list[bytes], contexts: dict[str, Any]) -> Any:
    tag, value = arg
    if tag == "k":
        return keys[value]
    if tag == "K":
        return [keys[i] for i in decode_indices(value)]
    if tag == "r":
        context = contexts.get(value)
        if context is None:
            context = contexts[value] = ReqContext(value)
        return context
    if tag == "x":
        return compat.decode_value(value)
    return value


def pinned(bundle: Bundle) -> list[int]:
    """Calls a minimised sequence keeps whatever else it drops: the failed load, and each latest lookup by its
    request that promised one of its keys (without the promise, a missing chunk is no bug)."""
    last = len(bundle.calls) - 1
    method, args, _, _ = bundle.calls[last]
    if method != "prepare_load" or len(args) != 2:
        return [last]  # another call's exception: no promise to keep
    keys, req = {bundle.keys[i] for i in decode_indices(args[0][1])}, args[1][1]  # by value: each segment
    promise: dict[bytes, int] = {}  # has its own key table, so one key may have two indices
    for index, (method, call_args, _, recorded) in enumerate(bundle.calls[:last]):
        key = bundle.keys[call_args[0][1]] if method == "lookup" else None
        if key is not None and call_args[1][1] == req and key in keys:
            if recorded in (str(compat.HIT), str(compat.HIT_PENDING)):
                promise[key] = index
            else:
                promise.pop(key, None)
    return [*sorted(promise.values()), last]


def minimize(bundle: Bundle, budget_s: float = 120.0,
             progress: Callable[[int], None] | None = None) -> list[int]:
    """The fewest calls (indices, in order) that still reproduce the failure, by ddmin; the pinned calls
    (:func:`pinned`) are always kept and must answer as recorded. Stops at ``budget_s`` with the smallest
    found so far."""
    keep = pinned(bundle)
    pin = set(keep)

    def fails(candidate: list[int]) -> bool:
        order = sorted(set(candidate) | pin)
        outcome = replay(bundle, order)
        pinned_positions = {position for position, i in enumerate(order) if i in pin}
        return outcome.reproduces(bundle) and not any(p in pinned_positions for p, _ in outcome.diverged)

    items = [i for i in range(len(bundle.calls)) if i not in pin]
    if not fails(items):
        raise ReplayError("the recorded calls do not reproduce the failure (replay the bundle without --minimize)")
    deadline = time.monotonic() + budget_s
    parts = 2
    while len(items) >= 1 and time.monotonic() < deadline:
        size = max(1, len(items) // parts)
        chunks = [items[i:i + size] for i in range(0, len(items), size)]
        reduced = False
        for chunk in chunks:  # try without each chunk (ddmin's complement step)
            dropped = set(chunk)
            rest = [i for i in items if i not in dropped]
            if fails(rest):
                items, parts, reduced = rest, max(parts - 1, 2), True
                break
            if time.monotonic() >= deadline:
                break
        if not reduced:
            if size == 1:
                break
            parts = min(len(items), parts * 2)
        if progress is not None:
            progress(len(items))
    return sorted(set(items) | pin)
