"""The taps: each stands in for one of vLLM's bound methods and records around it.

A tap calls the method with the caller's exact arguments, returns its result or lets its exception
through untouched, and captures what happened (``Recorder.push``, kvobs/hot_path.py: one call into the
capture ring, nothing allocated for it). Taps never
raise anything of kvobs's own: faults go to ``on_error(stage, exc)``. The Recorder makes the manager's
taps (``Recorder.lookup_tap``...); kvobs.vllm.compat sets the :class:`PolicyTap` family on vLLM's cache
policy. Part of the hot path (kvobs/hot_path_modules.py): compiled with it, loaded with it.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from kvobs.codes import DEFERRED_RELEASE, RESET, STORE_FAILED
from kvobs.hot_captures import _CALL, _FAILED_LOAD, _FINISH, _LOAD, _LOOKUP, _PROMOTED, _STORED

if TYPE_CHECKING:  # typing only: kvobs.hot_path imports this module (compiled, the type is native all the same)
    from kvobs.hot_path import Recorder

monotonic: Final = time.monotonic  # Final: compiled, a static read, not a lookup in the module's dict
get_ident: Final = threading.get_ident


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], pos: int, name: str) -> Any:
    """A call's argument by position, else by keyword (taps see the caller's exact arguments)."""
    if 0 <= pos < len(args):
        return args[pos]
    return kwargs.get(name)


# The taps are classes with vLLM's own parameter names, not ``*args, **kwargs`` closures: compiled,
# a call then costs about 20 ns instead of 80-130 (docs/performance.md). An optional parameter
# (``exclude_tier_idx``, ``success``) is forwarded only when the caller gave it, so the inner method
# sees exactly what the caller passed and raises what it would raise; kvobs.vllm.compat checks that
# vLLM's methods take these parameters.

_ABSENT: Final[Any] = object()


class LookupTap:
    """``lookup(key, req_context, **kw)``: captured; applied, a promise per HIT / HIT_PENDING, a void
    per other answer.

    ``marks_frame``: the lookup can remove chunks (tiering promotions), so removals
    under it are attributed to it.
    """

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
            except Exception as exc:
                rec.raised("lookup", exc, (key, req_context))
                raise
            finally:
                rec.frame = before
        else:
            try:
                if exclude_tier_idx is _ABSENT:
                    result = self.inner(key, req_context)
                else:
                    result = self.inner(key, req_context, exclude_tier_idx=exclude_tier_idx)
            except Exception as exc:
                rec.raised("lookup", exc, (key, req_context))
                raise
        try:
            req_id = req_context.req_id
        except Exception as exc:  # not a request context kvobs knows: nothing to capture, vLLM's answer stands
            rec.on_error("record.lookup", exc)
            return result
        rec.push_timed(_LOOKUP, key, req_id, result)  # the time last, read in the ring (kvobs/capture_ring.py)
        rec.call_pushed()
        return result


class KeysTap:
    """``name(keys, req_context, ...)`` (``complete_store``): removals under it are attributed to ``path``
    and the request."""

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
        except Exception as exc:
            rec.raised(self.name, exc, (keys, req_context))
            raise
        finally:
            rec.frame = before
        if rec.flight_calls:
            if success is _ABSENT:
                rec.flight_captured(self.name, keys, req_context, None, None)
            elif type(success) is bool:  # what vLLM passes: flat, its third argument kept as a bool
                rec.flight_captured(self.name, keys, req_context, None, success)
            else:
                rec.call_captured((_CALL, self.name, (keys, req_context, success), None, None))
        return result


class StoreTap:
    """``prepare_store(keys, req_context)``: as :class:`KeysTap`, and captures how many chunks it took to store
    (the recorder's fold counts them)."""

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
        except Exception as exc:
            rec.raised("prepare_store", exc, (keys, req_context))
            raise
        finally:
            rec.frame = before
        if result is not None:
            try:
                rec.push(_STORED, len(result.keys_to_store))  # kvobs.vllm.compat.STORED_FIELD; counted when applied
                rec.counted()
            except Exception as exc:
                rec.on_error("record.store", exc)
        if rec.flight_calls:
            rec.flight_captured("prepare_store", keys, req_context, result is not None, None)
        return result


class RequestTap:
    """``on_request_finished(req_context, **kw)``: removals under it attributed; then (captured) the request
    is gone."""

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
        except Exception as exc:
            rec.raised("on_request_finished", exc, (req_context,))
            raise
        finally:
            rec.frame = before
        try:
            req_id = req_context.req_id
        except Exception as exc:
            rec.on_error("record.finish", exc)
            return result
        if rec.flight_calls:
            rec.flight_live.pop(req_id, None)
        rec.push(_FINISH, req_id)
        rec.call_pushed()
        return result


class CallTap:
    """Any other call ``name`` that can remove chunks (``on_schedule_end``, ``reset_cache``): attributed to
    ``path``."""

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
        except Exception as exc:
            rec.raised(self.name, exc, args)
            raise
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
        try:
            result = self.inner(req_context)
        except Exception as exc:
            self.rec.raised("on_new_request", exc, (req_context,))
            raise
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
            rec.flight_captured("on_new_request", None, req_context, None, None)
        return result


class KeysPassTap:
    """``name(keys, req_context)`` (``complete_load``, ``touch``) while the flight recorder is on."""

    def __init__(self, rec: Recorder, inner: Callable[..., Any], name: str) -> None:
        self.rec = rec
        self.inner = inner
        self.name = name

    def __call__(self, keys: Any, req_context: Any) -> Any:
        try:
            result = self.inner(keys, req_context)
        except Exception as exc:
            self.rec.raised(self.name, exc, (keys, req_context))
            raise
        rec = self.rec
        if rec.flight_calls:
            rec.flight_captured(self.name, keys, req_context, None, None)
        return result


class PassTap:
    """A call kvobs records nothing about but the flight recorder keeps (``complete_load``,
    ``on_new_request``...): set only while the flight recorder is on."""

    def __init__(self, rec: Recorder, inner: Callable[..., Any], name: str) -> None:
        self.rec = rec
        self.inner = inner
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            result = self.inner(*args, **kwargs)
        except Exception as exc:
            self.rec.raised(self.name, exc, args)
            raise
        rec = self.rec
        if rec.flight_calls:
            rec.call_captured((_CALL, self.name, args, kwargs or None, None))
        return result


class WriteTap:
    """A tiering manager's CPU tier's ``prepare_write(keys, req_context)`` (vLLM's ``prepare_store`` under the
    name its promotions call): captures how many chunks it took, which the recorder's fold counts as written
    (kvobs.vllm.compat.PROMOTION_WRITE)."""

    def __init__(self, rec: Recorder, inner: Callable[..., Any]) -> None:
        self.rec = rec
        self.inner = inner

    def __call__(self, keys: Any, req_context: Any) -> Any:
        result = self.inner(keys, req_context)
        if result is not None:
            rec = self.rec
            try:
                rec.push(_PROMOTED, len(result.keys_to_store))  # kvobs.vllm.compat.STORED_FIELD
                rec.counted()
            except Exception as exc:
                rec.on_error("record.store", exc)
        return result

    def __reduce__(self) -> Any:
        return self.inner.__reduce__()

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return copy.deepcopy(self.inner, memo)


class LoadTap:
    """``prepare_load(keys, req_context)``: on success captured (applied: its near misses and the promises
    left to the history go to ``Recorder.near``, and its chunks count as loaded); on vLLM's assertion, the
    failed load is captured (applied: its near misses, as a load's) and then ``on_failure`` runs, whose
    diagnosis applies every capture once, on this thread, before it reads (``Observer.load_failed``).

    ``on_failure(exc, keys, req_context)`` runs before the assertion propagates (it appends
    the explanation to the same exception object); the assertion then leaves unchanged otherwise.
    What it returns decides: None, the assertion goes on (always, unless survive mode is on);
    anything else is returned instead (survive mode's load source, kvobs/vllm/survive.py).
    """

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
            try:  # captured in order: the diagnosis's one drain applies it with every call before it
                rec.capture((_FAILED_LOAD, keys, req_context.req_id))
            except Exception as fault:
                rec.on_error("record.load", fault)
            instead: object = None
            try:
                instead = self.on_failure(exc, keys, req_context)
            except Exception as fault:
                rec.on_error("diagnosis", fault)
            if instead is None:
                rec.raised("prepare_load", exc, (keys, req_context))  # reported unless it was explained
                raise
            return instead  # survive mode's decision, made once, in the failure callback
        except Exception as exc:
            self.rec.raised("prepare_load", exc, (keys, req_context))
            raise
        rec = self.rec
        try:
            req_id = req_context.req_id
        except Exception as exc:
            rec.on_error("record.load", exc)
            return result
        rec.push(_LOAD, keys, req_id, result)
        rec.call_pushed()
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
    # subclass defines into a class whose instances crash when called (tests/unit/test_recording.py calls them).
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
