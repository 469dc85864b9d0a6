"""ObservedOffloadingManager: a transparent OffloadingManager wrapper that keeps evidence.

Rules it follows (notes §2): every OffloadingManager method is overridden and
forwarded explicitly (with extra keyword arguments); ``lock`` is forwarded and
never entered here; ``take_events()`` is returned unchanged; attribute reads and
writes reach the inner manager. Only ``prepare_load`` ever raises something new:
vLLM's own AssertionError, same object, with the explanation appended.

How it forwards, cheaply: each method is an instance attribute set at
construction. Methods kvobs has nothing to record for are the inner manager's
own bound methods; the others are *taps* from :mod:`kvobs.recorder` (C when
built) that call the inner method and record around it. The class's methods
below do the same through those attributes, for callers that go through the
class.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from operator import attrgetter
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
from kvobs.observer import PATH_CODE, Observer
from kvobs.recorder import AFTER_FINISHED, AFTER_NONE, AFTER_PINNED
from kvobs.vllm.policy_hook import PolicyHook
from kvobs.vllm.trace_context import TraceHeaders

PASS_THROUGH = (
    "get_load_source",
    "touch",
    "complete_load",
    "on_new_request",
    "take_events",
    "has_pending_work",
    "on_reset_flushed",
    "get_stats",
    "config_info",
)
"""Methods forwarded as the inner manager's own bound methods (nothing to record)."""


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
        put = object.__setattr__
        put(self, "_kvobs_inner", inner)
        put(self, "_kvobs_observer", observer)
        cpu = cpu_tier_of(inner)
        put(self, "_kvobs_cpu", cpu)
        recorder = observer.recorder
        observer.refresh_sinks()
        hook = PolicyHook(cpu, recorder) if cpu is not None else None
        put(self, "_kvobs_hook", hook)
        for name in PASS_THROUGH:
            put(self, name, getattr(inner, name))
        # A plain CPU manager's lookup() cannot remove; tiering's can (promotions), so it marks its frame.
        lookup_removes = not isinstance(inner, CPUOffloadingManager)
        put(self, "lookup", recorder.lookup_tap(
            inner.lookup, PATH_CODE["lookup"], LookupResult.HIT, LookupResult.HIT_PENDING, lookup_removes))
        put(self, "prepare_load", recorder.load_tap(inner.prepare_load, self._kvobs_load_failed, observer.near_missed))
        put(self, "prepare_store", recorder.call_tap(inner.prepare_store, PATH_CODE["store"], 1, AFTER_NONE))
        if lookup_removes:  # tiering: its complete_store cascades to other tiers; keep the frame
            put(self, "complete_store", recorder.call_tap(
                inner.complete_store, PATH_CODE["complete_store"], 1, AFTER_NONE))
        else:  # a CPU manager removes there only failed stores, which find their caller (policy_hook)
            put(self, "complete_store", inner.complete_store)
        put(self, "on_request_finished", recorder.call_tap(
            inner.on_request_finished, PATH_CODE["schedule_end"], 0, AFTER_FINISHED))
        put(self, "on_schedule_end", recorder.call_tap(
            inner.on_schedule_end, PATH_CODE["schedule_end"], -1, AFTER_PINNED))
        put(self, "reset_cache", recorder.call_tap(inner.reset_cache, PATH_CODE["reset"], -1, AFTER_NONE))

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

    def _kvobs_tap(self, name: str) -> Any:
        return object.__getattribute__(self, "__dict__")[name]

    # -- OffloadingManager (the instance attributes set above answer first) ------------

    # The inner manager's lock, read without a Python frame (vLLM takes it every step).
    lock = property(attrgetter("_kvobs_inner.lock"), doc="The inner manager's lock (never entered by kvobs).")

    def lookup(self, key: OffloadKey, req_context: ReqContext, **kwargs: Any) -> LookupResult:
        return self._kvobs_tap("lookup")(key, req_context, **kwargs)

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> Any:
        return self._kvobs_inner.get_load_source(key, req_context)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        return self._kvobs_tap("prepare_load")(keys, req_context)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> Any:
        return self._kvobs_inner.touch(keys, req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> Any:
        return self._kvobs_inner.complete_load(keys, req_context)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        return self._kvobs_tap("prepare_store")(keys, req_context)

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> Any:
        return self._kvobs_tap("complete_store")(keys, req_context, success)

    def on_new_request(self, req_context: ReqContext, **kwargs: Any) -> RequestOffloadingContext:
        return self._kvobs_inner.on_new_request(req_context, **kwargs)

    def on_request_finished(self, req_context: ReqContext, **kwargs: Any) -> None:
        self._kvobs_tap("on_request_finished")(req_context, **kwargs)

    def take_events(self) -> Iterable[OffloadingEvent]:
        return self._kvobs_inner.take_events()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._kvobs_tap("on_schedule_end")(context)

    def has_pending_work(self) -> bool:
        return self._kvobs_inner.has_pending_work()

    def reset_cache(self) -> None:
        self._kvobs_tap("reset_cache")()

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

    def _kvobs_load_failed(self, exc: AssertionError, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """The load tap's callback on vLLM's assertion: near misses, then the explanation (never raises)."""
        try:
            self._kvobs_observer.loading(req_context.req_id, keys)
        except Exception as fault:
            self._kvobs_observer.internal_error("record.load", fault)
        self._kvobs_explain(exc, keys, req_context)

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

