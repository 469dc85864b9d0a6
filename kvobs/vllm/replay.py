"""``kvobs replay BUNDLE``: vLLM's real manager rebuilt from a bundle's snapshot, its recorded calls made again.

A bundle (kvobs/flight.py, written by kvobs.vllm.flight_recorder) holds the manager's state at the start
of its window, pickled with vLLM's own classes, and every call since. Replaying unpickles the state with
the installed vLLM (the bundle's release is required: a pickle of another release's classes would not
mean the same), makes each call on the bare manager (kvobs is not involved) and says whether vLLM's own
assertion happens at the same call with the same text. ``minimize`` shrinks the calls by delta debugging
(Zeller's ddmin) to the fewest that still fail the same way; ``emit_test`` writes them as a standalone
pytest file that needs vLLM alone.

A bundle is a pickle: replay only bundles you trust. The unpickler refuses any class outside vLLM and
the standard containers, which narrows what a crafted file can do, but does not make one safe.
"""

from __future__ import annotations

import io
import pickle
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.kv_offload.base import ReqContext

from kvobs.bundles import read_header, read_window
from kvobs.flight import Encoded, decode_indices
from kvobs.vllm import compat
from kvobs.vllm.flight_recorder import FAILED

_ALLOWED: dict[str, set[str]] = {
    "builtins": {"bytes", "bytearray", "dict", "frozenset", "int", "list", "set", "slice", "str",
                 "tuple", "float", "bool", "complex", "range", "object", "type"},
    "collections": {"OrderedDict", "deque", "defaultdict"},
    "copyreg": {"_reconstructor"},
    "_ctypes": {"_unpickle"},
    "enum": {"Enum", "IntEnum"},
}


class ReplayError(Exception):
    """The bundle cannot be replayed here; the message says why."""


class _VllmOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "vllm" or module.startswith("vllm.") or name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise ReplayError(f"the bundle names {module}.{name}, which is not one of vLLM's classes: refused")


def _loads(blob: bytes) -> Any:
    return _VllmOnly(io.BytesIO(blob)).load()


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
    """Read a bundle; ReplayError when it cannot be replayed with the installed vLLM (naming why)."""
    try:
        header = read_header(path)
    except ValueError as exc:
        raise ReplayError(str(exc)) from exc
    window = header.get("window") or {}
    if not window.get("replayable"):
        raise ReplayError(f"{path}: the bundle holds no window to replay: {window.get('why_not') or 'no reason given'}")
    recorded = header.get("vllm_version")
    if recorded != compat.VLLM_VERSION:
        raise ReplayError(f"{path} was recorded on vLLM {recorded}; this Python has vLLM {compat.VLLM_VERSION}: "
                          f"replay it with vLLM {recorded} installed (its state is pickled with that release's "
                          "classes)")
    try:
        payload = _loads(read_window(path))
        return Bundle(path, header, payload["state"], list(payload["keys"]), list(payload["calls"]))
    except ReplayError:
        raise
    except Exception as exc:
        raise ReplayError(f"{path}: the window does not read: {type(exc).__name__}: {exc}") from exc


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
        """vLLM's own assertion, the recorded text, at the last call (the load that failed)."""
        failure = bundle.failure
        return (failure is not None and self.raised_at == self.calls - 1 and self.exception == FAILED
                and self.message == failure.get("vllm_message"))


def replay(bundle: Bundle, indices: Sequence[int] | None = None) -> Outcome:
    """Make the bundle's calls (``indices`` of them, in order; all by default) on a manager unpickled from its
    snapshot; stop at the first exception."""
    manager, contexts = _loads(bundle.state)
    chosen = range(len(bundle.calls)) if indices is None else indices
    outcome = Outcome(calls=len(chosen))
    for position, index in enumerate(chosen):
        method, args, kwargs, recorded = bundle.calls[index]
        real = [_decode(arg, bundle.keys, contexts) for arg in args]
        try:
            result = getattr(manager, method)(*real, **({} if kwargs is None else _loads(kwargs)))
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
    if tag == "p":
        return _loads(value)
    return value


def pinned(bundle: Bundle) -> list[int]:
    """Calls a minimised sequence keeps whatever else it drops: the failed load, and each latest lookup by its
    request that promised one of its keys (without the promise, a missing chunk is no bug)."""
    last = len(bundle.calls) - 1
    _, args, _, _ = bundle.calls[last]
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
