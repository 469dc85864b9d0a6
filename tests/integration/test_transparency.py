"""Wrapped and bare managers given the same operations behave the same (first version)."""

from __future__ import annotations

import abc
import random
from typing import Any

import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext

import kvobs
from kvobs.vllm import compat
from tests.support.twin_driver import Twin, apply, random_op, same
from tests.support.vllm_env import cpu_extra, create_manager, key, tiering_extra

SEQUENCES = 40
OPS_PER_SEQUENCE = 120


@pytest.mark.parametrize(
    "extra",
    [cpu_extra(6, _events=True), cpu_extra(6, eviction_policy="arc", _events=True), tiering_extra(6, _events=True)],
    ids=["cpu-lru", "cpu-arc", "tiering"],
)
def test_random_sequences_give_identical_outcomes(extra: dict[str, Any]) -> None:
    failures_seen = 0
    for seed in range(SEQUENCES):
        rng = random.Random(seed)
        bare = Twin(create_manager(dict(extra)))
        observed = kvobs.observe(create_manager(dict(extra)))
        wrapped = Twin(observed)
        try:
            for step in range(OPS_PER_SEQUENCE):
                op, req, keys, flag = random_op(rng, num_keys=10, num_requests=3)
                expected, got = apply(bare, op, req, keys, flag), apply(wrapped, op, req, keys, flag)
                assert same(expected, got, op), (seed, step, op, req, keys, expected, got)
                if op == "prepare_load" and got.error is not None:
                    failures_seen += 1
            assert not +observed.observer.internal_errors, observed.observer.internal_errors
        finally:
            bare.manager.shutdown()
            observed.shutdown()
    assert failures_seen > 0  # the sequences did reach the failure path


def test_attributes_read_and_written_reach_the_inner_manager() -> None:
    inner = create_manager(cpu_extra(4))
    m = kvobs.observe(inner)
    try:
        policy = inner._policy  # type: ignore[attr-defined]
        assert m._policy is policy and type(policy).__name__ == "LRUCachePolicy"
        m.store_threshold = 7
        assert inner.store_threshold == 7  # type: ignore[attr-defined]
        if compat.HAS_LOCK:
            assert type(m.lock) is type(inner.lock)  # a fresh nullcontext per call, forwarded
        assert hasattr(m, "lock") is hasattr(inner, "lock")  # none before 0.33, as on the bare manager
        for name in ("get_load_source", "on_reset_flushed", "config_info"):  # 0.32 / 0.33 only
            assert hasattr(m, name) is hasattr(inner, name), name
        assert m.take_events is not None and list(m.take_events()) == []
    finally:
        m.shutdown()


@pytest.mark.skipif(not compat.HAS_LOCK, reason="vLLM < 0.33 has no manager lock")
def test_tiering_lock_is_the_inner_managers_real_lock() -> None:
    inner = create_manager(tiering_extra(4))
    m = kvobs.observe(inner)
    try:
        assert m.lock is inner.lock and m.lock is inner._lock  # type: ignore[attr-defined]
    finally:
        m.shutdown()


def test_observing_twice_is_refused() -> None:
    inner = create_manager(cpu_extra(4))
    m = kvobs.observe(inner)
    try:
        with pytest.raises(ValueError, match="already observed"):
            kvobs.observe(m)
        with pytest.raises(ValueError, match="already observed"):
            kvobs.observe(inner)
    finally:
        m.shutdown()


def test_observe_rejects_what_is_not_a_manager() -> None:
    with pytest.raises(TypeError, match="needs a vLLM OffloadingManager"):
        kvobs.observe(object())


def test_a_manager_kvobs_cannot_hook_is_still_explained_for_the_named_key() -> None:
    """Any OffloadingManager: no policy hook, but the key vLLM names is still classified."""
    from vllm.v1.kv_offload.base import LookupResult, OffloadingManager

    class OneKeyManager(OffloadingManager):
        def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:  # type: ignore[override]
            return LookupResult.HIT

        def prepare_load(self, keys: Any, req_context: ReqContext) -> Any:
            raise AssertionError(f"Chunk {next(iter(keys))!r} not found in cache")

        def prepare_store(self, keys: Any, req_context: ReqContext) -> Any:
            return None

        def on_new_request(self, req_context: ReqContext) -> Any:
            return None

    m = kvobs.observe(OneKeyManager())
    a = ReqContext("req-a")
    m.lookup(key(1), a)
    with pytest.raises(AssertionError, match=r"1 of 2 keys in this load are missing.*cause: unknown"):
        m.prepare_load([key(1), key(2)], a)


def test_a_method_assigned_through_the_wrapper_is_the_one_called_and_kvobs_keeps_recording() -> None:
    """How tracing and profiling code instruments ``connector_scheduler.manager``: wrap a method,
    call through, restore it. Same as on the bare manager; the original still records."""
    m = kvobs.observe(create_manager(cpu_extra(2)))
    try:
        calls: list[str] = []
        original = m.prepare_store

        def traced(keys: Any, req_context: Any) -> Any:
            calls.append("prepare_store")
            return original(keys, req_context)

        m.prepare_store = traced
        assert m.prepare_store is traced
        a, b = ReqContext("req-a"), ReqContext("req-b")
        m.prepare_store([key(1), key(2)], a)
        m.complete_store([key(1), key(2)], a)
        m.prepare_store([key(3), key(4)], b)  # evicts: recorded through the original's tap
        assert calls == ["prepare_store", "prepare_store"] and m.observer.evicted["capacity"] == 2
        stats = []
        m.get_stats = lambda: stats.append(1) or "mine"
        assert m.get_stats() == "mine" and stats == [1]
        del m.prepare_store, m.get_stats  # undo the monkeypatch: kvobs's own come back
        assert m.prepare_store is original and m.get_stats() != "mine"
        with pytest.raises(AttributeError):
            del m.prepare_store  # nothing set on the instance any more, as on the bare manager
        m.complete_store([key(3), key(4)], b)
        m.prepare_store([key(5)], a)
        assert m.observer.evicted["capacity"] == 3
        m.custom_flag = 1  # data attributes still reach the inner manager, both ways
        assert m.inner.custom_flag == 1
        del m.custom_flag
        assert not hasattr(m.inner, "custom_flag")
    finally:
        m.shutdown()


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "copy"])
def test_copies_behave_as_copies_of_the_bare_manager(how: str) -> None:
    import copy
    import pickle

    bare, m = create_manager(cpu_extra(2)), kvobs.observe(create_manager(cpu_extra(2)))
    make = {"deepcopy": copy.deepcopy, "pickle": lambda x: pickle.loads(pickle.dumps(x)), "copy": copy.copy}[how]
    try:
        a, b = ReqContext("req-a"), ReqContext("req-b")
        for manager in (bare, m):
            manager.prepare_store([key(1), key(2)], a)
            manager.complete_store([key(1), key(2)], a)
        bare_twin, twin = make(bare), make(m)
        assert type(twin) is type(m)
        outcomes = []
        for manager in (bare_twin, twin):
            assert manager.lookup(key(1), b) is LookupResult.HIT
            manager.prepare_store([key(3), key(4)], b)
            with pytest.raises(AssertionError) as failed:
                manager.prepare_load([key(1)], b)
            outcomes.append(str(failed.value))
        assert outcomes[1].startswith(outcomes[0])  # the same failure, explained by the copy
        assert "cause: evicted_after_lookup" in outcomes[1]
        if how == "copy":  # a shallow copy shares the cache policy, as the bare manager's does
            assert twin.observer is m.observer
        else:  # an independent manager: the original's cache and evidence are untouched
            assert twin.observer is not m.observer and m.observer.evicted["capacity"] == 0
            assert m.lookup(key(1), b) is LookupResult.HIT
    finally:
        m.shutdown()


def test_copying_a_tiering_manager_fails_as_the_bare_one_does() -> None:
    import copy

    bare, m = create_manager(tiering_extra(2)), kvobs.observe(create_manager(tiering_extra(2)))
    try:
        errors = []
        for manager in (bare, m):
            with pytest.raises(TypeError) as info:
                copy.deepcopy(manager)
            errors.append(str(info.value))
        assert errors[0] == errors[1]
    finally:
        bare.shutdown()
        m.shutdown()


def test_every_method_of_vllms_manager_has_a_row_in_the_protocol_table() -> None:
    """compat.PROTOCOL is the one place the manager protocol is written: every abstract method of this
    release's OffloadingManager has a row (compat.check() refuses a release where one has not), and so
    does every other method (one the table lacks would reach the base class's default on the wrapper,
    not the inner manager's)."""
    from vllm.v1.kv_offload.base import OffloadingManager

    from kvobs.vllm import ObservedOffloadingManager

    abstract = OffloadingManager.__abstractmethods__
    assert abstract and compat.unknown_abstract_methods() == []
    assert set(abstract) <= set(compat.PROTOCOL_BY_NAME)
    methods = {name for name, value in vars(OffloadingManager).items()
               if not name.startswith("_") and callable(value)}
    assert methods <= set(compat.PROTOCOL_BY_NAME), methods - set(compat.PROTOCOL_BY_NAME)
    assert all(row.tap in compat.TAP_KINDS for row in compat.PROTOCOL)
    # The wrapper's class is concrete, and has exactly the rows this release's base class has (lock: a property).
    assert not ObservedOffloadingManager.__abstractmethods__
    for row in compat.PROTOCOL:
        own = vars(ObservedOffloadingManager).get(row.name)
        assert callable(own) == (row.everywhere or hasattr(OffloadingManager, row.name)), row.name

    class NewAbstract(OffloadingManager):
        @abc.abstractmethod
        def a_method_of_a_future_release(self) -> None: ...

    assert compat.unknown_abstract_methods(NewAbstract) == ["a_method_of_a_future_release"]


@pytest.mark.parametrize("flight_calls", [0, 50_000], ids=["no-recorder", "recorder"])
def test_the_wrappers_methods_follow_the_protocol_table(flight_calls: int) -> None:
    """Tapped rows are kvobs's taps, pass-through rows the inner manager's own bound methods (but those the
    flight recorder keeps, compat.FLIGHT_PASS, while it runs), rows of a method the release lacks absent; a
    call through the class answers as the instance's tap."""
    observed = kvobs.observe(create_manager(cpu_extra(4)), flight_calls=flight_calls)
    inner = observed.inner
    try:
        for row in compat.PROTOCOL:
            if row.tap == "shutdown":
                assert "shutdown" not in vars(observed)
            elif not hasattr(inner, row.name):
                assert not row.everywhere and row.name not in vars(observed)
            elif row.tap == "pass" and row.name != "get_stats" and not (
                flight_calls and row.name in compat.FLIGHT_PASS
            ):
                assert getattr(observed, row.name) == getattr(inner, row.name), row.name
            else:
                assert getattr(observed, row.name) is observed._kvobs_taps[row.name], row.name
        req = ReqContext("r")
        assert type(observed).lookup(observed, key(1), req) == inner.lookup(key(1), req)
        assert type(observed).has_pending_work(observed) == inner.has_pending_work()
    finally:
        observed.shutdown()


class _ContextWithoutRequestId(ReqContext):
    """vLLM's request context but for ``req_id``, which raises: vLLM's method may never read it, kvobs's taps
    must not turn vLLM's answer into an exception when they do."""

    def __getattribute__(self, name: str) -> Any:
        if name == "req_id":
            raise AttributeError("this context has no req_id")
        return super().__getattribute__(name)


_WITH_A_REQUEST = [row.name for row in compat.PROTOCOL if row.recorded and "req" in row.recorded]


@pytest.mark.parametrize("name", _WITH_A_REQUEST)
def test_a_context_without_a_request_id_gets_what_the_bare_manager_gives_with_the_recorder_on(name: str) -> None:
    bare = create_manager(cpu_extra(4))
    observed = kvobs.observe(create_manager(cpu_extra(4)), flight_calls=50_000)
    if not hasattr(bare, name):
        pytest.skip(f"{name} is not in this release")
    kinds = compat.PROTOCOL_BY_NAME[name].recorded or ()

    def outcome(manager: Any) -> str:
        stand_ins = {"key": key(1), "keys": [key(1)], "req": _ContextWithoutRequestId("r"), "": True}
        try:
            return f"returned {type(getattr(manager, name)(*(stand_ins[k] for k in kinds))).__name__}"
        except Exception as exc:  # what vLLM raises, the same through kvobs (its message aside: prepare_load's)
            return f"raised {type(exc).__name__}"

    try:
        assert outcome(observed) == outcome(bare)
    finally:
        observed.shutdown()
