"""The flight recorder on a vLLM manager: started with its observer; a replay bundle at every failed load.

The window itself is kvobs/flight.py's; this module knows the manager it snapshots (kvobs.vllm.compat
``snapshot_state``, ``CALL_ARGS``) and writes bundles into ``<dir>/replay/`` (the newest
``MAX_BUNDLES`` kept), or wherever :func:`write_bundle` is asked to. ``kvobs replay`` reads them
(kvobs.vllm.bundle_replay).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.base import OffloadingManager

from kvobs import __version__, forks
from kvobs.bundles import BUNDLE_DIR, REQUESTED_DIR, keep_bundles, new_bundle, write_bundle as write_bundle_file
from kvobs.flight import FlightWindow, encode_window
from kvobs.hot_path_loader import CALL
from kvobs.observer import Observer
from kvobs.replay_requests import Answerer, Request
from kvobs.vllm import compat

if TYPE_CHECKING:
    from kvobs.boundary import OffloadException
    from kvobs.journal import JournalSink

FAILED = "AssertionError"
"""The answer recorded for the load that failed (kvobs.vllm.bundle_replay compares against it)."""

logger = logging.getLogger("kvobs")

LIMITS = (
    "request contexts are replayed as plain ReqContext objects with their id, vLLM's own per-request state and "
    "key positions (nothing of the prompt): a manager that reads the scheduler's request fields may diverge",
    "only the CPU manager's calls are recorded: transfers happen in the worker, so a replay makes the calls "
    "in the order the scheduler made them, which is the order the manager saw",
)
"""What a replay cannot reproduce, said in every bundle (README, 'Replay a failure')."""

_UNSNAPSHOTTABLE = (compat.ProtocolMismatch, TypeError, OverflowError, AttributeError)
"""What writing a state raises for a manager kvobs cannot snapshot whole (kvobs.state_codec.encode)."""

SURVIVED_BUNDLE_EVERY_S = 60.0
"""A load survive mode recomputed writes a bundle at most this often (each takes the scheduler thread a
fraction of a second; the engine goes on)."""

_sequence = 0
_sequence_lock = threading.Lock()
forks.track(sys.modules[__name__])  # the lock is renewed in a forked child (kvobs/forks.py)


def start(manager: OffloadingManager, observer: Observer) -> FlightWindow | None:
    """Start the flight recorder on ``manager`` (the inner manager) when the options keep one and its state
    can be snapshotted; None (and the reason in ``observer.flight_off_reason``) when not."""
    options = observer.options
    if options.flight_window <= 0:
        observer.flight_off_reason = "the flight recorder is off (flight_calls is 0: README, 'Replay a failure')"
        return None
    # Asked for by number and not possible: a warning, once. On by default and not possible: said at INFO.
    say = logger.warning if options.flight_asked else logger.info
    reason = compat.flight_unsupported(manager)
    if reason is not None:
        observer.flight_off_reason = reason
        say("kvobs: no flight recorder on this engine: %s", reason)
        return None
    rec = observer.recorder
    try:  # a manager kvobs cannot snapshot whole (an attribute its class does not set): no recorder, said once
        compat.snapshot_state(manager, [])
    except _UNSNAPSHOTTABLE as exc:
        observer.flight_off_reason = str(exc)
        say("kvobs: no flight recorder on this engine: %s", exc)
        return None
    window = FlightWindow(rec, options.flight_bytes, compat.CALL_ARGS, compat.encode_value)
    observer.flight = window

    def unsnapshottable(exc: Exception) -> None:
        window.off(f"the manager's state cannot be snapshotted any more: {exc!r}")
        observer.flight_off_reason = window.off_reason
        logger.warning("kvobs: flight recorder off: %s", window.off_reason)

    def snapshot() -> Any:
        """The state now, frozen on vLLM's thread (the cheap half: kvobs.vllm.compat.freeze_state); None, and
        the recorder off with the reason, when it cannot be read any more (an attribute vLLM does not set): a
        limit, not a fault of kvobs's."""
        try:
            return compat.freeze_state(manager, list(rec.flight_live.values()))
        except _UNSNAPSHOTTABLE as exc:
            unsnapshottable(exc)
            return None

    def on_snapshot(frozen: Any) -> None:
        """A frozen state was applied: written as data here, by whoever applies (kvobs's applier, mostly), and
        a new segment starts from it; an object of a class outside the snapshot table turns the recorder off."""
        try:
            state = compat.encode_state(frozen)
        except _UNSNAPSHOTTABLE as exc:
            unsnapshottable(exc)
            return
        window.on_snapshot(state)

    rec.flight_on(on_snapshot, snapshot, options.flight_window)
    return window


def _header(manager: OffloadingManager, observer: Observer, window: FlightWindow | None) -> dict[str, Any]:
    options = observer.options
    return {
        "kvobs_version": __version__,
        "vllm_version": compat.VLLM_VERSION,
        "manager": f"{type(manager).__module__}.{type(manager).__qualname__}",
        "engine": options.engine,
        "model_name": options.model_name,
        "created": time.time(),
        "options": {"flight_calls": options.flight_window, "flight_bytes": options.flight_bytes},
        "snapshots": 0 if window is None else window.snapshots,
        "limits": list(LIMITS) + [f"vLLM's manager has methods kvobs forwards unrecorded ({', '.join(forwarded)}): "
                                  "a replay does not make those calls" for forwarded in [compat.unknown_methods()]
                                  if forwarded],
    }


def write_bundle(
    path: str | os.PathLike[str],
    manager: OffloadingManager,
    observer: Observer,
    failure: dict[str, Any] | None = None,
    failing_call: tuple[str, tuple[Any, ...], str] | None = None,
    requested: str | None = None,
    drained: bool = False,
) -> int:
    """Write ``manager``'s flight window to ``path`` (with the call that failed, when there is one: its method,
    arguments and the exception's type name); its size. The window is read with every capture applied
    (``Observer.applied``; ``drained``: a failed load's diagnosis applied them). A window over ``flight_bytes``
    is left out (the header says why)."""
    window: FlightWindow | None = observer.flight
    header = _header(manager, observer, window)
    last = None if failing_call is None else (CALL, failing_call[0], failing_call[1], None, failing_call[2])
    empty: tuple[bytes | None, float, list[bytes], list[Any]] = (None, 0.0, [], [])
    state, since, keys, calls = empty if window is None else window.window(
        observer.applied(lambda: window.view(last), drained=drained))
    reason = observer.flight_why_not()
    blob = None
    if state is not None:
        blob = encode_window(state, keys, calls)
        if len(blob) > observer.options.flight_bytes:
            reason = f"the window takes {len(blob)} bytes, over flight_bytes ({observer.options.flight_bytes})"
            blob = None
    header["window"] = {
        "calls": len(calls) if blob is not None else 0,
        "keys": len(keys) if blob is not None else 0,
        "since": since,
        "replayable": blob is not None,
        "why_not": None if blob is not None else reason or "no snapshot taken yet",
    }
    if failure is not None:
        header["failure"] = failure
    if requested is not None:
        header["requested"] = requested  # the sidecar's request it answers (kvobs/replay_requests.py)
    return write_bundle_file(str(path), header, blob)


def _bundle_in_dir(
    manager: OffloadingManager, observer: Observer, failure: dict[str, Any] | None = None,
    failing_call: tuple[str, tuple[Any, ...], str] | None = None, requested: str | None = None,
    drained: bool = False,
) -> tuple[Path, int]:
    """A bundle in ``<dir>/replay/`` (the oldest beyond ``MAX_BUNDLES`` deleted), or in ``replay/requested/``
    when the sidecar asked for it (this engine's oldest beyond ``MAX_BUNDLES`` deleted): its path and size."""
    global _sequence
    with _sequence_lock:
        _sequence += 1
        sequence = _sequence
    folder = Path(str(observer.options.dir)) / BUNDLE_DIR
    engine = observer.options.engine or "0"
    if requested is not None:
        folder = folder / REQUESTED_DIR
    path = new_bundle(folder, engine, os.getpid(), sequence)
    size = write_bundle(path, manager, observer, failure, failing_call, requested, drained)
    keep_bundles(folder, engine if requested is not None else None)
    return path, size


def answer_requests(manager: OffloadingManager, observer: Observer, journal: JournalSink) -> None:
    """Answer the sidecar's requests for bundles (``POST /api/v1/replays``: kvobs/replay_requests.py) from
    ``journal``'s writer thread: a bundle per request, written as at a failure but with no failure in it
    (and without a window, its header saying why, when the recorder is off)."""
    def answer(request: Request) -> None:
        path, size = _bundle_in_dir(manager, observer, requested=request.id)
        logger.info("kvobs: replay bundle requested through the sidecar: %s (%d bytes)", path, size)

    journal.between_flushes = Answerer(str(observer.options.dir), observer.options.engine or "0", answer).poll


def bundle_on_failure(
    manager: OffloadingManager, observer: Observer, keys: Collection[bytes], req_context: Any,
    vllm_message: str, message: str, cause: str, *, recomputed: bool = False,
) -> str | None:
    """At a failed load, where the observer writes bundles (:meth:`Observer.writes_bundles`): the bundle beside the
    failure reports (``<dir>/replay/``), the oldest beyond ``MAX_BUNDLES`` deleted, and one log line saying
    where (the engine is about to die). A load survive mode recomputed gets a bundle at most every
    ``SURVIVED_BUNDLE_EVERY_S`` and no log line (the engine goes on; kvobs's own line said it). Its path, or
    None."""
    if not observer.writes_bundles():
        return None
    now = time.monotonic()
    if recomputed:
        last = observer.last_bundle_at
        if last is not None and now - last < SURVIVED_BUNDLE_EVERY_S:
            return None
    observer.last_bundle_at = now
    failure = {"method": "prepare_load", "req_id": req_context.req_id, "exception_type": FAILED,
               "vllm_message": vllm_message, "message": message, "cause": cause, "recomputed": recomputed}
    path, size = _bundle_in_dir(manager, observer, failure, ("prepare_load", (list(keys), req_context), FAILED),
                                drained=True)  # the diagnosis (Observer.load_failed) applied every capture
    if not recomputed:
        why_not = observer.flight_why_not()
        if why_not is None:
            logger.error("kvobs: replay bundle for this failure: %s (%d bytes); reproduce it with: kvobs replay %s",
                         path, size, path)
        else:
            logger.error("kvobs: replay bundle for this failure: %s, without a window to replay (%s)", path, why_not)
    return str(path)


def bundle_on_exception(manager: OffloadingManager, observer: Observer, method: str, args: tuple[Any, ...],
                        exc: BaseException, failure: OffloadException) -> str | None:
    """At an exception leaving vLLM's manager through a tap (kvobs/vllm/manager.py), where the observer writes
    bundles (:meth:`Observer.writes_bundles`): a bundle whose window ends with that call, as
    :func:`bundle_on_failure` writes one for a failed load (``kvobs replay`` makes the calls again and expects the
    same exception there), at most one every ``SURVIVED_BUNDLE_EVERY_S`` with any other bundle (survive mode
    answers some, and they can repeat). Its path, or None (no bundles written, a method the recorder does not
    record, one written too recently)."""
    if not observer.writes_bundles() or method not in compat.CALL_ARGS:
        return None
    now = time.monotonic()
    last = observer.last_bundle_at
    if last is not None and now - last < SURVIVED_BUNDLE_EVERY_S:
        return None  # bounded time on the scheduler thread: a survived one repeats (a tier that keeps failing)
    req_ids = list(failure.req_ids)
    record = {"method": method, "req_id": req_ids[0] if req_ids else None, "exception_type": type(exc).__name__,
              "vllm_message": failure.vllm_message, "message": failure.message, "cause": failure.cause,
              "site": None if failure.site is None else failure.site.to_json(), "recomputed": False}
    observer.last_bundle_at = now
    path, size = _bundle_in_dir(manager, observer, record, (method, tuple(args), type(exc).__name__))
    logger.error("kvobs: replay bundle for this exception: %s (%d bytes); reproduce it with: kvobs replay %s",
                 path, size, path)
    return str(path)
