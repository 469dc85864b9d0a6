"""Wrapped and bare managers given the same operations behave the same (first version)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from twin_driver import Twin, apply, random_op, same
from vllm.v1.kv_offload.base import ReqContext
from vllm_env import cpu_extra, create_manager, key, tiering_extra

import kvobs
from kvobs.vllm import compat

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
