"""ObservedOffloadingManager: a transparent OffloadingManager wrapper that keeps evidence.

Rules it follows (notes §2): every OffloadingManager method is overridden and
forwarded explicitly (with extra keyword arguments); ``lock`` is forwarded and
never entered here; ``take_events()`` is returned unchanged; attribute reads and
writes reach the inner manager. Only ``prepare_load`` ever raises something new:
vLLM's own AssertionError, same object, with the explanation appended.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Sequence
from contextlib import AbstractContextManager
from threading import get_ident
from typing import Any

from vllm.v1.kv_offload.base import (
    ConfigInfoMapping,
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

from kvobs.diagnosis import MISSING, NOT_READY
from kvobs.keys import key_group
from kvobs.observer import Observer
from kvobs.verdicts import Verdict
from kvobs.vllm.policy_hook import PolicyHook, on_poll_thread
from kvobs.vllm.trace_context import TraceHeaders

_new_verdict = tuple.__new__
monotonic = time.monotonic

_HIT = LookupResult.HIT
_HIT_PENDING = LookupResult.HIT_PENDING


class _Frame:
    """Which wrapped call is on the stack, for whom and on which thread (read by the policy hook).

    A slotted object set in place: the wrapper pays three slot writes per call, not
    attribute writes through its own ``__setattr__``.
    """

    __slots__ = ("path", "req", "thread")

    def __init__(self) -> None:
        self.path = "unobserved"
        self.req: ReqContext | None = None
        self.thread = 0


def cpu_tier_of(manager: OffloadingManager) -> CPUOffloadingManager | None:
    """The CPU-resident manager whose policy sees every removal, if kvobs knows it."""
    if isinstance(manager, TieringOffloadingManager):
        return manager.primary_tier
    if isinstance(manager, CPUOffloadingManager):
        return manager
    return None


class ObservedOffloadingManager(OffloadingManager):
    """Wraps ``inner``; same results, same exceptions, same events, plus evidence."""

    def __init__(self, inner: OffloadingManager, observer: Observer) -> None:
        object.__setattr__(self, "_kvobs_inner", inner)
        object.__setattr__(self, "_kvobs_observer", observer)
        # Which wrapped call is on the stack (read by the policy hook for `path`).
        object.__setattr__(self, "_kvobs_frame", _Frame())
        cpu = cpu_tier_of(inner)
        object.__setattr__(self, "_kvobs_cpu", cpu)
        # A plain CPU manager's lookup() cannot remove; tiering's can (promotions).
        object.__setattr__(self, "_kvobs_lookup_removes", not isinstance(inner, CPUOffloadingManager))
        hook = PolicyHook(cpu, self._kvobs_on_removal) if cpu is not None else None
        object.__setattr__(self, "_kvobs_hook", hook)

    # -- attribute transparency ---------------------------------------------

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_kvobs_inner"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_kvobs_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._kvobs_inner, name, value)

    @property
    def observer(self) -> Observer:
        """The evidence kvobs keeps for this manager."""
        return self._kvobs_observer

    @property
    def inner(self) -> OffloadingManager:
        return self._kvobs_inner

    @property
    def cpu_policy(self) -> Any:
        """The hooked cache policy of the CPU tier (None for a manager kvobs cannot hook)."""
        return None if self._kvobs_cpu is None else self._kvobs_cpu._policy

    # -- removal reports from the policy hook ----------------------------------

    def _kvobs_on_removal(
        self, keys: Sequence[bytes], reason: str, residency: Sequence[float] | None, now: float
    ) -> None:
        try:
            frame = self._kvobs_frame
            if get_ident() == frame.thread:
                path, req = frame.path, (None if frame.req is None else frame.req.req_id)
            else:
                path, req = ("poll_thread" if on_poll_thread() else "unobserved"), None
            self._kvobs_observer.removed(keys, reason, path, req, residency, now)
        except Exception as exc:
            self._kvobs_observer.internal_error("record.removal", exc)

    def _kvobs_enter(self, path: str, req_context: ReqContext | None) -> _Frame:
        frame = self._kvobs_frame
        frame.path = path
        frame.req = req_context
        frame.thread = get_ident()
        return frame

    # -- OffloadingManager ------------------------------------------------------

    @property
    def lock(self) -> AbstractContextManager[Any]:
        return self._kvobs_inner.lock

    def lookup(self, key: OffloadKey, req_context: ReqContext, **kwargs: Any) -> LookupResult:
        if self._kvobs_lookup_removes:
            frame = self._kvobs_enter("lookup", req_context)
            try:
                result = self._kvobs_inner.lookup(key, req_context, **kwargs)
            finally:
                frame.thread = 0
        else:
            result = self._kvobs_inner.lookup(key, req_context, **kwargs)
        try:
            observer = self._kvobs_observer
            if result is _HIT or result is _HIT_PENDING:  # Observer.reported, inlined (every lookup hit)
                verdict = _new_verdict(Verdict, (observer.history.next_serial, monotonic(), result is _HIT_PENDING))
                observer.verdicts.reported(req_context.req_id, key, verdict)
            else:
                observer.verdicts.not_reported(req_context.req_id, key)
        except Exception as exc:
            self._kvobs_observer.internal_error("record.lookup", exc)
        return result

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> Any:
        return self._kvobs_inner.get_load_source(key, req_context)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        try:
            spec = self._kvobs_inner.prepare_load(keys, req_context)
        except AssertionError as exc:
            self._kvobs_loading(keys, req_context)
            self._kvobs_explain(exc, keys, req_context)
            raise
        self._kvobs_loading(keys, req_context)
        return spec

    def _kvobs_loading(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        try:
            self._kvobs_observer.loading(req_context.req_id, keys)
        except Exception as exc:
            self._kvobs_observer.internal_error("record.load", exc)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> Any:
        return self._kvobs_inner.touch(keys, req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> Any:
        return self._kvobs_inner.complete_load(keys, req_context)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        frame = self._kvobs_enter("store", req_context)
        try:
            return self._kvobs_inner.prepare_store(keys, req_context)
        finally:
            frame.thread = 0

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> Any:
        frame = self._kvobs_enter("complete_store", req_context)
        try:
            return self._kvobs_inner.complete_store(keys, req_context, success)
        finally:
            frame.thread = 0

    def on_new_request(self, req_context: ReqContext, **kwargs: Any) -> RequestOffloadingContext:
        return self._kvobs_inner.on_new_request(req_context, **kwargs)

    def on_request_finished(self, req_context: ReqContext, **kwargs: Any) -> None:
        frame = self._kvobs_enter("schedule_end", req_context)
        try:
            self._kvobs_inner.on_request_finished(req_context, **kwargs)
        finally:
            frame.thread = 0
        try:
            self._kvobs_observer.verdicts.finished(req_context.req_id)
        except Exception as exc:
            self._kvobs_observer.internal_error("record.finish", exc)

    def take_events(self) -> Iterable[OffloadingEvent]:
        return self._kvobs_inner.take_events()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        frame = self._kvobs_enter("schedule_end", None)
        try:
            self._kvobs_inner.on_schedule_end(context)
        finally:
            frame.thread = 0
        try:
            verdicts = self._kvobs_observer.verdicts
            for req_id in context.new_req_ids:  # scheduled this step: their loads are prepared
                verdicts.pinned(req_id)
        except Exception as exc:
            self._kvobs_observer.internal_error("record.schedule_end", exc)

    def has_pending_work(self) -> bool:
        return self._kvobs_inner.has_pending_work()

    def reset_cache(self) -> None:
        frame = self._kvobs_enter("reset", None)
        try:
            self._kvobs_inner.reset_cache()
        finally:
            frame.thread = 0

    def on_reset_flushed(self) -> None:
        self._kvobs_inner.on_reset_flushed()

    def get_stats(self) -> Any:
        return self._kvobs_inner.get_stats()

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        return self._kvobs_inner.config_info()

    def shutdown(self) -> None:
        try:
            self._kvobs_inner.shutdown()
        finally:
            try:
                self._kvobs_observer.close()
            except Exception as exc:
                self._kvobs_observer.internal_error("shutdown", exc)

    # -- the explanation ------------------------------------------------------------

    def _kvobs_explain(self, exc: AssertionError, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Append kvobs's diagnosis to vLLM's assertion (same object, same traceback)."""
        try:
            vllm_message = str(exc)
            keys = list(keys)
            unloadable = self._kvobs_unloadable(keys, req_context, vllm_message)
            positions = [p for k in keys if (p := req_context.get_offload_key_position(k)) is not None]
            token_range = (min(positions), max(positions)) if positions else None
            failing = next((g for k, g, _, _ in unloadable if repr(k) in vllm_message), None)
            carried = req_context.get_state(TraceHeaders)
            diagnosis = self._kvobs_observer.load_failed(
                vllm_message, req_context.req_id, len(keys), token_range, unloadable, failing,
                trace_headers=None if carried is None else carried.headers,
            )
            exc.args = (diagnosis.message, *exc.args[1:])
        except Exception as fault:  # the original assertion still propagates
            self._kvobs_observer.internal_error("diagnosis", fault)
            return
        self._kvobs_observer.publish_failure(diagnosis, exc)

    def _kvobs_unloadable(
        self, keys: list[OffloadKey], req_context: ReqContext, vllm_message: str
    ) -> list[tuple[bytes, int, int | None, str]]:
        """(key, group, end_token, state) of every key of the load that cannot be read."""
        cpu = self._kvobs_cpu
        out: list[tuple[bytes, int, int | None, str]] = []
        for key in keys:
            if cpu is not None:
                chunk = cpu._policy.get(key)
                if chunk is not None and chunk.is_ready:
                    continue
                state = MISSING if chunk is None else NOT_READY
            elif repr(key) in vllm_message:  # an unknown manager: only the named key is known
                state = NOT_READY if "not ready" in vllm_message else MISSING
            else:
                continue
            out.append((key, key_group(key), req_context.get_offload_key_position(key), state))
        return out

