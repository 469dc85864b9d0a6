"""ObservedOffloadingManager: a transparent OffloadingManager wrapper that keeps evidence.

Transparent means: same results, same exceptions, same events as the inner manager;
``lock`` forwarded and never entered here; ``take_events()`` returned unchanged; and
whatever a caller does with an attribute of the wrapper, it does as on the bare manager:

* data attributes are read, set and deleted on the inner manager;
* a method assigned on the wrapper (``manager.prepare_store = traced``) is what callers of
  ``manager.prepare_store`` get, and deleting it brings kvobs's own back, as an instance
  attribute shadows a class's method; a replacement that calls the method it replaced keeps
  kvobs recording;
* ``copy.copy`` shares the evidence (the copy shares the cache policy, as a bare copy does);
  ``copy.deepcopy`` and ``pickle`` give an independent, freshly observed manager with no
  journal (its evidence would otherwise mix with the original's under one engine label),
  and fail where the bare manager's do.

How it forwards, cheaply: each method is an instance attribute set at construction, as the one
table of the protocol, ``compat.PROTOCOL``, says (the class's methods are built from it too). Methods
kvobs has nothing to record for are the inner manager's own bound methods; the others are
taps from :mod:`kvobs.hot_path_loader` (compiled when built) that call the inner method and record
around it, each handed out so that it introspects as the inner method (``inspect.signature``,
``functools.wraps``, ``mock.create_autospec``: :mod:`kvobs.vllm.signatures`). Only ``prepare_load``
ever raises something kvobs touched: vLLM's own AssertionError, the same object, with the
explanation appended.

What kvobs does not know reaches the inner manager all the same. The wrapper is a subclass of vLLM's
``OffloadingManager``, so a method with a default body that a release adds to it (as ``get_load_source``
came in 0.32), an abstract one, a property or a class attribute would be answered by the base class,
not by the inner manager's override. Every such name (``compat.unknown_attributes``) is forwarded,
unobserved: a method is the inner manager's own bound method on the instance (nothing per call) and a
forwarding method on the class (which also keeps the class concrete when the method is abstract),
anything else a property reading the inner manager's. The class follows vLLM's base class each time a
manager is wrapped (:func:`_forward_unknown`). ``kvobs doctor`` lists what is forwarded so; fields vLLM
adds to what kvobs reads (``ReqContext``, ``PrepareStoreOutput``, ``OffloadingEvent``, a new
``LookupResult``) pass through untouched: kvobs hands on the same objects.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import inspect
from collections import deque
from collections.abc import Callable, Collection, Sequence
from operator import attrgetter
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import OffloadingManager

from kvobs.codes import PATH_CODE
from kvobs.diagnosis import MISSING, NOT_READY
from kvobs.keys import key_group
from kvobs.observer import Observer, Unloadable
from kvobs.options import Options
from kvobs.vllm import compat, vllm_metrics
from kvobs.vllm.boundary import Boundary
from kvobs.vllm.evidence import observer_for
from kvobs.vllm.signatures import class_signature, dressed
from kvobs.vllm.survive import Survival
from kvobs.vllm.trace_context import TraceHeaders


def _taps(inner: OffloadingManager, observer: Observer, load_failed: Callable[..., None]) -> dict[str, Any]:
    """kvobs's entry point for every manager method the inner manager has, as ``compat.PROTOCOL``
    says (``shutdown`` aside: the wrapper's class method, which also closes the observer). Pass-through
    methods are the inner manager's own bound methods; ``get_stats`` also adds kvobs's counters when
    the ``vllm_metrics`` option is on (kvobs/vllm/vllm_metrics.py)."""
    rec = observer.recorder
    flight = observer.flight is not None  # the flight recorder also keeps compat.FLIGHT_PASS's calls
    taps: dict[str, Any] = {}
    for row in compat.PROTOCOL:
        name, kind = row.name, row.tap
        if kind == "shutdown" or not hasattr(inner, name):
            continue  # a method only some releases have: the wrapper has it where the inner manager does
        method = getattr(inner, name)
        path = -1 if row.path is None else PATH_CODE[row.path]
        if kind == "pass":
            taps[name] = (rec.pass_tap(method, name=name, shape=compat.CALL_ARGS[name])
                          if flight and name in compat.FLIGHT_PASS else method)
        elif kind == "lookup":
            taps[name] = rec.lookup_tap(method, path=path, hit=compat.HIT, hit_pending=compat.HIT_PENDING,
                                        marks_frame=compat.lookup_can_remove(inner))
        elif kind == "load":
            taps[name] = rec.load_tap(method, on_failure=load_failed)
        elif kind == "store":
            taps[name] = rec.store_tap(method, path=path)
        elif kind == "keys":
            taps[name] = rec.keys_tap(method, path=path, name=name)
        elif kind == "request":
            taps[name] = rec.request_tap(method, path=path)
        elif kind == "call":
            taps[name] = rec.call_tap(method, path=path, name=name)
        else:
            raise compat.ProtocolMismatch(f"compat.PROTOCOL: {name} has an unknown tap kind {kind!r}")
    for name in compat.unknown_methods():  # a method kvobs has no row for: the inner manager's own (compat.check)
        method = getattr(inner, name, None)
        if callable(method):
            taps[name] = method
    api = vllm_metrics.stats_api(observer.options)  # None unless the vllm_metrics option is on
    if api is not None and "get_stats" in taps:
        taps["get_stats"] = vllm_metrics.StatsTap(inner.get_stats, observer, api[1])
    return taps


def _class_method(name: str, takes_arguments: bool) -> Callable[..., Any]:
    """The wrapper's class method ``name``: what its tap answers (for a call through the class;
    an instance's attribute of the same name shadows it)."""
    def forwarding(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self._kvobs_taps[name](*args, **kwargs)

    def without_arguments(self: Any) -> Any:
        return self._kvobs_taps[name]()

    method = forwarding if takes_arguments else without_arguments
    method.__name__ = name
    method.__qualname__ = f"ObservedOffloadingManager.{name}"
    method.__doc__ = f"The inner manager's ``{name}``, through kvobs's tap (``compat.PROTOCOL``)."
    method.__signature__ = class_signature(OffloadingManager, name)  # type: ignore[attr-defined]
    return method


def _unknown_method(name: str) -> Callable[..., Any]:
    """The wrapper's class method for a method of vLLM's ``OffloadingManager`` that kvobs has no
    ``compat.PROTOCOL`` row for: the inner manager's, unobserved (an instance's own bound method of the inner
    manager shadows it, as for a pass-through row)."""
    def forwarding(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._kvobs_inner, name)(*args, **kwargs)

    forwarding.__name__ = name
    forwarding.__qualname__ = f"ObservedOffloadingManager.{name}"
    forwarding.__doc__ = f"The inner manager's ``{name}``, forwarded unobserved (not in ``compat.PROTOCOL``)."
    forwarding.__signature__ = class_signature(OffloadingManager, name)  # type: ignore[attr-defined]
    return forwarding


def _unknown_data(name: str) -> property:
    """The wrapper's property for data of vLLM's ``OffloadingManager`` kvobs does not know: the inner
    manager's (setting and deleting it reach the inner manager through the wrapper's ``__setattr__`` and
    ``__delattr__``)."""
    return property(attrgetter(f"_kvobs_inner.{name}"),
                    doc=f"The inner manager's ``{name}``, forwarded unobserved (not in ``compat.PROTOCOL``).")


def _forwarder(name: str, attribute: Any) -> Any:
    """What the wrapper's class has for vLLM's base-class ``attribute`` called ``name``, a release-only
    ``compat.PROTOCOL`` row or a name kvobs does not know (``compat.unknown_attributes``); None: nothing, the
    base class's own is right (a class- or staticmethod: on the instance it is the inner manager's)."""
    row = compat.PROTOCOL_BY_NAME.get(name)
    if row is not None:
        return _class_method(name, row.args != () or bool(row.keywords))
    if isinstance(attribute, (classmethod, staticmethod)):
        return _unknown_method(name) if getattr(attribute, "__isabstractmethod__", False) else None
    return _unknown_method(name) if compat.is_method(attribute) else _unknown_data(name)


def _forward_unknown(cls: type[ObservedOffloadingManager]) -> None:
    """Make the wrapper's class answer, with the inner manager's, every name of vLLM's ``OffloadingManager``
    it would otherwise answer with the base class's default: the ``compat.PROTOCOL`` rows only some releases
    have, when this one has them, and every name kvobs has no row for (``compat.unknown_attributes``).
    Follows the base class as it is now (a name gone is taken back) and keeps the class concrete; called
    when the class is made and each time a manager is wrapped (cheap when nothing changed)."""
    wanted = {row.name: inspect.getattr_static(OffloadingManager, row.name) for row in compat.PROTOCOL
              if not row.everywhere and hasattr(OffloadingManager, row.name)}
    wanted.update((name, inspect.getattr_static(OffloadingManager, name)) for name in compat.unknown_attributes())
    done = cls._kvobs_forwarded
    if done.keys() == wanted.keys() and all(done[name] is wanted[name] for name in wanted):
        return
    for name in [name for name in done if name not in wanted or done[name] is not wanted[name]]:
        del done[name]
        if name in vars(cls):
            delattr(cls, name)
    for name, attribute in wanted.items():
        if name in done or name in vars(cls):  # kvobs's own name (compat.check refuses a vLLM that has it)
            continue
        done[name] = attribute
        forwarder = _forwarder(name, attribute)
        if forwarder is not None:
            setattr(cls, name, forwarder)
    abc.update_abstractmethods(cls)


def _protocol_methods(cls: type[ObservedOffloadingManager]) -> type[ObservedOffloadingManager]:
    """Give the wrapper's class a method for every ``compat.PROTOCOL`` row every release has (its own
    ``shutdown`` aside), forward what the rest of vLLM's base class has (:func:`_forward_unknown`), and
    recompute what it leaves abstract (nothing)."""
    for row in compat.PROTOCOL:
        if row.everywhere and row.tap != "shutdown":
            setattr(cls, row.name, _class_method(row.name, row.args != () or bool(row.keywords)))
    _forward_unknown(cls)
    return cls


@_protocol_methods
class ObservedOffloadingManager(OffloadingManager):
    """Wraps ``inner``; same results, same exceptions, same events, plus evidence (see the module)."""

    _kvobs_forwarded: ClassVar[dict[str, Any]] = {}
    """What :func:`_forward_unknown` forwards: each name, with the base-class attribute it stands for."""

    def __init__(self, inner: OffloadingManager, observer: Observer) -> None:
        put = object.__setattr__
        put(self, "_kvobs_inner", inner)
        put(self, "_kvobs_observer", observer)
        put(self, "_kvobs_cpu", compat.cpu_tier_of(inner))
        taps = _taps(inner, observer, self._kvobs_load_failed)
        observer.recorder.on_raise = self._kvobs_raised
        put(self, "_kvobs_bundled", deque(maxlen=4))
        put(self, "_kvobs_boundary", Boundary("manager", lambda: observer))  # reports what leaves the manager
        # Survive mode (opt-in): the load and its completion pass through it; else nothing changes.
        survival = Survival(inner, observer) if observer.options.survive and self._kvobs_cpu is not None else None
        put(self, "_kvobs_survival", survival)
        if survival is not None:  # prepare_load's decision comes back from _kvobs_load_failed
            taps["complete_load"] = survival.complete_through(taps["complete_load"])
            taps["reset_cache"] = survival.reset_through(taps["reset_cache"])
        taps = {name: dressed(tap, getattr(inner, name)) for name, tap in taps.items()}  # introspect as inner's
        put(self, "_kvobs_taps", taps)
        for name, tap in taps.items():
            put(self, name, tap)

    # -- attribute transparency ---------------------------------------------

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_kvobs_inner"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_kvobs_") or name in self._kvobs_taps:
            object.__setattr__(self, name, value)  # a method replaced on this object, as on the bare manager
        else:
            setattr(self._kvobs_inner, name, value)

    def __delattr__(self, name: str) -> None:
        tap = self._kvobs_taps.get(name)
        if tap is None:
            delattr(self._kvobs_inner, name)
        elif self.__dict__.get(name) is tap:  # nothing was set on the instance, as on the bare manager
            raise AttributeError(name)
        else:
            object.__setattr__(self, name, tap)

    def __copy__(self) -> ObservedOffloadingManager:
        twin = ObservedOffloadingManager._kvobs_wrap(copy.copy(self._kvobs_inner), self._kvobs_observer)
        for name, value in self.__dict__.items():
            if name in self._kvobs_taps and value is not self._kvobs_taps[name]:
                object.__setattr__(twin, name, value)  # what the caller assigned is copied, as on the bare manager
        return twin

    def __deepcopy__(self, memo: dict[int, Any]) -> ObservedOffloadingManager:
        return self._kvobs_observed(copy.deepcopy(self._kvobs_inner, memo), self._kvobs_copy_options())

    def __reduce__(self) -> Any:
        options = dataclasses.replace(self._kvobs_copy_options(), tracer_provider=None)
        return (ObservedOffloadingManager._kvobs_observed, (self._kvobs_inner, options))

    @classmethod
    def _kvobs_observed(cls, inner: OffloadingManager, options: Options) -> ObservedOffloadingManager:
        """A copy's ``inner`` (an unobserved manager: a copied policy gets its plain methods back),
        freshly observed."""
        return cls._kvobs_wrap(inner, observer_for(inner, options))

    @classmethod
    def _kvobs_wrap(cls, inner: OffloadingManager, observer: Observer) -> ObservedOffloadingManager:
        """``cls(inner, observer)``; for the type checker, which cannot see the class methods
        ``@_protocol_methods`` sets, the one place it is instantiated. The class first follows vLLM's base
        class (:func:`_forward_unknown`)."""
        _forward_unknown(cls)
        return cls(inner, observer)

    def _kvobs_copy_options(self) -> Any:
        return dataclasses.replace(self._kvobs_observer.options, dir=None)

    @property
    def observer(self) -> Observer:
        """The evidence kvobs keeps for this manager."""
        return self._kvobs_observer

    @property
    def inner(self) -> OffloadingManager:
        return self._kvobs_inner

    @property
    def survival(self) -> Survival | None:
        """Survive mode's state, when the ``survive`` option is on and kvobs knows the CPU tier (kvobs's
        connector arms it)."""
        return self._kvobs_survival

    @property
    def cpu_policy(self) -> Any:
        """The hooked cache policy of the CPU tier (None for a manager kvobs cannot hook)."""
        return None if self._kvobs_cpu is None else compat.policy_of(self._kvobs_cpu)

    # -- OffloadingManager, called through the class ---------------------------------
    # Every method of compat.PROTOCOL that every release has is a class method too, answered by its
    # tap (set by @_protocol_methods). Methods only some releases have (get_load_source,
    # on_reset_flushed, config_info, touch) are instance attributes, set when the inner manager has
    # them (the wrapper has exactly the inner manager's methods), and class methods where this
    # release's base class has them; so is every method vLLM's base class has that kvobs has no row
    # for, forwarded unobserved (_forward_unknown).

    # The inner manager's lock, read without a Python frame (vLLM takes it every step).
    lock = property(attrgetter("_kvobs_inner.lock"), doc="The inner manager's lock (never entered by kvobs).")

    def shutdown(self) -> None:
        try:
            self._kvobs_inner.shutdown()
        finally:
            try:
                self._kvobs_observer.close()
            except Exception as exc:
                self._kvobs_observer.internal_error("shutdown", exc)

    # -- the explanation ------------------------------------------------------------

    def _kvobs_raised(self, method: str, exc: BaseException, args: tuple[Any, ...]) -> None:
        """A tap's callback on an exception leaving vLLM's manager (``prepare_load``'s assertion, explained, aside:
        ``Observer.explained``): reported as at the connector's boundary (site, request, span, counter, log line,
        failure report: kvobs/vllm/boundary.py, side ``manager``) unless kvobs's connector above reports it with
        the requests' lifecycle (``Observer.guarded``); and, with the flight recorder on, a replay bundle whose
        window ends with this call (the state is the manager's). Never raises (the recorder counts a fault)."""
        observer = self._kvobs_observer
        if any(e is exc for e in observer.explained) or any(e is exc for e in self._kvobs_bundled):
            return
        boundary = self._kvobs_boundary
        failure = None if observer.guarded else boundary.left(method, exc, args)
        if observer.writes_bundles():
            self._kvobs_bundled.append(exc)  # an outer tap of the same call (tiering) writes none again
            try:
                from kvobs.vllm.flight_recorder import bundle_on_exception

                bundle_on_exception(self._kvobs_inner, observer, method, args, exc,
                                    failure or boundary.failure(method, exc, args))
            except Exception as fault:
                observer.internal_error("flight", fault)

    def _kvobs_load_failed(self, exc: AssertionError, keys: Collection[bytes], req_context: Any) -> Any:
        """The load tap's callback on vLLM's assertion, after it redeemed the near misses: the
        explanation, and survive mode's decision: the load source to return instead of raising
        (the padded one survive mode made), or None for the assertion to go on. Never raises."""
        observer = self._kvobs_observer
        survival = self._kvobs_survival
        keys = list(keys)
        recomputed = False
        try:
            vllm_message = str(exc)
            unloadable = self._kvobs_unloadable(list(keys), req_context, vllm_message)
            recomputed = survival is not None and survival.try_survive(keys, unloadable, req_context, vllm_message)
            positions = [p for k in keys if (p := compat.key_position(req_context, k)) is not None]
            token_range = (min(positions), max(positions)) if positions else None
            failing = next((u.group for u in unloadable if repr(u.key) in vllm_message), None)
            carried = req_context.get_state(TraceHeaders)
            diagnosis = observer.load_failed(
                vllm_message, req_context.req_id, len(keys), token_range, unloadable, failing,
                trace_headers=None if carried is None else carried.headers, recomputed=recomputed,
            )
            exc.args = (diagnosis.message, *exc.args[1:])
        except Exception as fault:  # the original assertion still propagates (or survive's source returns)
            observer.internal_error("diagnosis", fault)
        else:
            observer.explained.append(exc)  # the connector's boundary reports it no second time
            observer.publish_failure(diagnosis, exc)
            try:
                from kvobs.vllm.flight_recorder import bundle_on_failure

                bundle_on_failure(self._kvobs_inner, observer, keys, req_context, vllm_message,
                                  diagnosis.message, diagnosis.cause, recomputed=recomputed)
            except Exception as fault:
                observer.internal_error("flight", fault)
        return survival.take_source() if recomputed and survival is not None else None

    def _kvobs_unloadable(self, keys: Sequence[bytes], req_context: Any, vllm_message: str) -> list[Unloadable]:
        """Every key of the load that cannot be read, with its group, end token, state and expected tier."""
        cpu = self._kvobs_cpu
        out: list[Unloadable] = []
        for key in keys:
            if cpu is not None:
                state = compat.chunk_state(cpu, key)
                if state is None:
                    continue
            elif repr(key) in vllm_message:  # an unknown manager: only the named key is known
                state = NOT_READY if "not ready" in vllm_message else MISSING
            else:
                continue
            out.append(Unloadable(key, key_group(key), compat.key_position(req_context, key), state,
                                  compat.expected_tier(self._kvobs_inner, key, req_context)))
        return out
