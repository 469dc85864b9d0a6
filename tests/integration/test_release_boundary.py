"""A vLLM that adds methods or fields (issue 40, item 6): what kvobs does not know reaches vLLM's manager.

The wrapper is a subclass of vLLM's ``OffloadingManager``: a method with a default body that a release adds
to the base class, and its managers override (as ``get_load_source`` came in 0.32), would otherwise be
answered by the base class's default, silently. Each test adds such a release's change at test time
(onto vLLM's own classes, undone after it), builds the observed manager through kvobs's real path (the
plugin, as vLLM loads it: ``OffloadingSpecFactory``) and compares with the bare manager. Runs on every
supported release (0.30.0-0.34.0).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from vllm.v1.kv_offload import base
from vllm.v1.kv_offload.base import LookupResult, OffloadingManager, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

from kvobs.vllm import ObservedOffloadingManager, compat, doctor
from tests.support.vllm_env import cpu_extra, create_manager, create_spec, key, observed_extra, tiering_extra

END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
KINDS = [pytest.param(cpu_extra(4, _events=True), id="cpu"), pytest.param(tiering_extra(4, _events=True), id="tiering")]
NEW = "tier_hint"
"""The name of the method (or attribute) a future release adds to ``OffloadingManager``."""


def observed(extra: dict[str, Any], **options: Any) -> Any:
    """The manager vLLM gets from kvobs's plugin around the inner spec of ``extra``."""
    return create_spec(observed_extra(extra, **options)).get_manager()


@pytest.fixture
def made() -> Iterator[list[Any]]:
    """Managers a test built, shut down after it (before its changes to vLLM are undone)."""
    managers: list[Any] = []
    yield managers
    for manager in managers:
        manager.shutdown()


def add_method(monkeypatch: pytest.MonkeyPatch, *, abstract: bool = False) -> None:
    """A release whose ``OffloadingManager`` has ``tier_hint(key, req_context, *, detail=False)``, a default body
    (or abstract), that both built-in managers override."""
    def default(self: Any, key: bytes, req_context: Any, *, detail: bool = False) -> Any:
        return "the base class's default"

    if abstract:
        default = abc.abstractmethod(default)
    monkeypatch.setattr(OffloadingManager, NEW, default, raising=False)
    if abstract:
        monkeypatch.setattr(OffloadingManager, "__abstractmethods__",
                            OffloadingManager.__abstractmethods__ | {NEW})
    for cls in (CPUOffloadingManager, TieringOffloadingManager):
        def override(self: Any, key: bytes, req_context: Any, *, detail: bool = False, _cls: type = cls) -> Any:
            return (_cls.__name__, key, req_context.req_id, detail, id(self))

        monkeypatch.setattr(cls, NEW, override, raising=False)


@pytest.mark.parametrize("abstract", [False, True], ids=["default-body", "abstract"])
@pytest.mark.parametrize("extra", KINDS)
def test_a_method_a_release_adds_answers_as_the_inner_managers(
    extra: dict[str, Any], abstract: bool, monkeypatch: pytest.MonkeyPatch, made: list[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    add_method(monkeypatch, abstract=abstract)
    assert compat.unknown_attributes() == [NEW] and compat.unknown_methods() == [NEW]
    assert compat.unknown_abstract_methods() == ([NEW] if abstract else [])
    bare = create_manager(dict(extra))
    made.append(bare)
    manager = observed(dict(extra))
    made.append(manager)
    assert isinstance(manager, ObservedOffloadingManager), "kvobs stepped aside"  # observed, not refused
    assert f"but not {NEW}: vLLM's OffloadingManager has them and kvobs does not know them" in caplog.text
    inner = manager.inner
    context = ReqContext("req-a")
    answer = manager.tier_hint(key(1), context, detail=True)
    assert answer == (type(inner).__name__, key(1), "req-a", True, id(inner))  # the inner manager's, not the default
    assert answer[:4] == bare.tier_hint(key(1), context, detail=True)[:4]
    assert manager.tier_hint == inner.tier_hint  # its own bound method: nothing of kvobs's per call
    assert type(manager).tier_hint(manager, key(2), context)[1:3] == (key(2), "req-a")  # through the class too
    assert not type(manager).__abstractmethods__
    # A method assigned through the wrapper shadows it, and deleting it brings the inner manager's back.
    manager.tier_hint = lambda *args, **kwargs: "assigned"
    assert manager.tier_hint(key(1), context) == "assigned" and inner.tier_hint(key(1), context) != "assigned"
    del manager.tier_hint
    assert manager.tier_hint == inner.tier_hint
    # The tapped methods are kvobs's taps as before (forwarding adds nothing to them), and still record.
    for name in ("lookup", "prepare_load", "prepare_store", "complete_store", "reset_cache"):
        assert getattr(manager, name) is manager._kvobs_taps[name], name
    manager.on_new_request(context)
    manager.prepare_store([key(1)], context)
    manager.complete_store([key(1)], context)
    manager.on_schedule_end(END)
    assert manager.lookup(key(1), context) is LookupResult.HIT
    assert not +manager.observer.internal_errors


def test_a_method_no_manager_overrides_answers_the_base_classes_default(
    monkeypatch: pytest.MonkeyPatch, made: list[Any]
) -> None:
    """As on the bare manager: the inner manager's answer is the base class's own default."""
    monkeypatch.setattr(OffloadingManager, NEW, lambda self: ("default", type(self).__name__), raising=False)
    manager = observed(cpu_extra(4))
    made.append(manager)
    assert manager.tier_hint() == ("default", "CPUOffloadingManager")


def test_data_a_release_adds_is_the_inner_managers(monkeypatch: pytest.MonkeyPatch, made: list[Any]) -> None:
    """A class attribute and a property with a default on the base class, overridden by the manager."""
    monkeypatch.setattr(OffloadingManager, "supports_tier_hints", False, raising=False)
    monkeypatch.setattr(CPUOffloadingManager, "supports_tier_hints", True, raising=False)
    monkeypatch.setattr(OffloadingManager, "tier_name", property(lambda self: "base"), raising=False)
    monkeypatch.setattr(CPUOffloadingManager, "tier_name", property(lambda self: f"cpu:{id(self)}"), raising=False)
    manager = observed(cpu_extra(4))
    made.append(manager)
    assert isinstance(manager, ObservedOffloadingManager)
    assert manager.supports_tier_hints is True
    assert manager.tier_name == f"cpu:{id(manager.inner)}"
    manager.supports_tier_hints = "set"  # written on the inner manager, as every data attribute
    assert manager.inner.supports_tier_hints == "set" and manager.supports_tier_hints == "set"
    del manager.supports_tier_hints
    assert manager.supports_tier_hints is True


def test_what_a_release_no_longer_has_the_wrapper_no_longer_has(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wrapper's class follows vLLM's base class each time a manager is wrapped."""
    with monkeypatch.context() as patch:
        add_method(patch, abstract=True)
        manager = observed(cpu_extra(4))
        try:
            assert callable(vars(ObservedOffloadingManager)[NEW])
        finally:
            manager.shutdown()
    manager = observed(cpu_extra(4))
    try:
        assert NEW not in vars(ObservedOffloadingManager) and not hasattr(manager, NEW)
        assert not ObservedOffloadingManager.__abstractmethods__
    finally:
        manager.shutdown()


def test_a_name_the_wrapper_uses_for_its_own_makes_the_plugin_step_aside(
    monkeypatch: pytest.MonkeyPatch, made: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A release whose OffloadingManager has ``inner`` (kvobs's wrapper answers it with its own): kvobs steps
    aside, says which, and vLLM gets its manager as it built it."""
    monkeypatch.setattr(OffloadingManager, "inner", lambda self: "vLLM's", raising=False)
    manager = observed(cpu_extra(4))
    made.append(manager)
    assert type(manager) is CPUOffloadingManager and manager.inner() == "vLLM's"
    assert "kvobs steps aside" in caplog.text and "OffloadingManager has inner" in caplog.text


def test_a_method_the_manager_makes_data_makes_the_plugin_step_aside(
    monkeypatch: pytest.MonkeyPatch, made: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(OffloadingManager, NEW, lambda self: "default", raising=False)
    monkeypatch.setattr(CPUOffloadingManager, NEW, property(lambda self: "data"), raising=False)
    manager = observed(cpu_extra(4))
    made.append(manager)
    assert type(manager) is CPUOffloadingManager and manager.tier_hint == "data"
    assert f"CPUOffloadingManager makes {NEW} data" in caplog.text


def test_doctor_lists_what_it_forwards_unobserved(monkeypatch: pytest.MonkeyPatch) -> None:
    add_method(monkeypatch, abstract=True)
    monkeypatch.setattr(OffloadingManager, "supports_tier_hints", False, raising=False)
    report = doctor.diagnose(None)
    assert report.status == doctor.OBSERVES, report.render()
    assert report.data["forwarded_unobserved"] == {"methods": [NEW], "abstract": [NEW],
                                                   "other": ["supports_tier_hints"]}
    said = dict(report.lines)
    assert said["forwarded"].startswith(f"unobserved: supports_tier_hints, {NEW}() (abstract): vLLM ")
    assert "hands each to CPUOffloadingManager's own" in said["forwarded"]


def test_doctor_forwards_nothing_on_a_supported_release() -> None:
    report = doctor.diagnose(None)
    assert report.data["forwarded_unobserved"] == {"methods": [], "abstract": [], "other": []}
    assert "forwarded" not in dict(report.lines)


# -- fields vLLM adds to what kvobs reads --------------------------------------------------------------


@dataclasses.dataclass
class NewPrepareStoreOutput(base.PrepareStoreOutput):
    tier_hint: str = "a field of a future release"


@dataclasses.dataclass
class NewReqContext(ReqContext):
    priority: int = 7


@dataclasses.dataclass
class NewOffloadingEvent(base.OffloadingEvent):
    tier_hint: str = "a field of a future release"


class NewLookupResult(enum.Enum):
    """A lookup answer kvobs does not know (as ``RETRY`` was once new): neither HIT nor HIT_PENDING."""

    PROMOTING = 99


def with_new_prepare_store_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """A release whose ``PrepareStoreOutput`` has one more field: every vLLM module that builds it builds that."""
    released = base.PrepareStoreOutput
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm.v1.kv_offload") and getattr(module, "PrepareStoreOutput", None) is released:
            monkeypatch.setattr(module, "PrepareStoreOutput", NewPrepareStoreOutput)
    monkeypatch.setattr(compat, "PrepareStoreOutput", NewPrepareStoreOutput)


@pytest.mark.parametrize("flight_calls", [0, 50_000], ids=["no-recorder", "recorder"])
@pytest.mark.parametrize("extra", KINDS)
def test_fields_a_release_adds_pass_through_untouched(
    extra: dict[str, Any], flight_calls: int, monkeypatch: pytest.MonkeyPatch, made: list[Any]
) -> None:
    with_new_prepare_store_output(monkeypatch)
    seen: list[tuple[str, Any]] = []
    for cls in {CPUOffloadingManager, type(create_manager_for(extra, made))}:
        for name in ("lookup", "prepare_store", "complete_store", "prepare_load", "on_request_finished"):
            spy(monkeypatch, cls, name, seen)
        original_events = cls.take_events

        def take_events(self: Any, _original: Any = original_events) -> Any:
            return [NewOffloadingEvent(**{f.name: getattr(e, f.name) for f in dataclasses.fields(e)})
                    for e in _original(self)]

        monkeypatch.setattr(cls, "take_events", take_events)
    manager = observed(dict(extra), flight_calls=flight_calls)
    made.append(manager)
    assert isinstance(manager, ObservedOffloadingManager), "kvobs stepped aside"
    context = NewReqContext("req-a", priority=3)
    manager.on_new_request(context)
    stored = manager.prepare_store([key(1), key(2)], context)
    assert type(stored) is NewPrepareStoreOutput and stored.tier_hint == "a field of a future release"
    assert stored.keys_to_store == [key(1), key(2)]
    manager.complete_store([key(1), key(2)], context)
    manager.on_schedule_end(END)
    assert manager.lookup(key(1), context) is LookupResult.HIT
    manager.prepare_load([key(1)], context)
    manager.complete_load([key(1)], context)
    manager.on_request_finished(context)
    events = list(manager.take_events())
    assert events and all(type(e) is NewOffloadingEvent and e.tier_hint for e in events)
    # The inner manager got the very context vLLM passed, its new field intact, and handed back its own results.
    assert seen and all(got is context and got.priority == 3 for _, got in seen)
    assert {name for name, _ in seen} >= {"lookup", "prepare_store", "complete_store", "prepare_load"}
    assert not +manager.observer.internal_errors


def create_manager_for(extra: dict[str, Any], made: list[Any]) -> Any:
    manager = create_manager(dict(extra))
    made.append(manager)
    return manager


def spy(monkeypatch: pytest.MonkeyPatch, cls: type, name: str, seen: list[tuple[str, Any]]) -> None:
    """``cls.name`` records the request context it is given (its second argument, or its first)."""
    original = getattr(cls, name)

    def spied(self: Any, *args: Any, **kwargs: Any) -> Any:
        context = next((a for a in args if isinstance(a, ReqContext)), None)
        if context is not None and context.req_id == "req-a":
            seen.append((name, context))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, spied)


def test_a_lookup_answer_kvobs_does_not_know_passes_through(monkeypatch: pytest.MonkeyPatch, made: list[Any]) -> None:
    original = CPUOffloadingManager.lookup

    def lookup(self: Any, key: bytes, req_context: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, key, req_context, *args, **kwargs)
        return NewLookupResult.PROMOTING if result is LookupResult.MISS else result

    monkeypatch.setattr(CPUOffloadingManager, "lookup", lookup)
    manager = observed(cpu_extra(4))
    made.append(manager)
    context = ReqContext("req-a")
    manager.on_new_request(context)
    assert manager.lookup(key(1), context) is NewLookupResult.PROMOTING
    manager.prepare_store([key(2)], context)
    manager.complete_store([key(2)], context)
    assert manager.lookup(key(2), context) is LookupResult.HIT
    assert not +manager.observer.internal_errors
