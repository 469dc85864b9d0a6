"""Every cause, reproduced for real on vLLM's managers (every supported release), named correctly in the message."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext

from kvobs.vllm import ObservedOffloadingManager, compat
from tests.support.causes import END, ctx, failed_load, observed, store
from tests.support.vllm_env import cpu_extra, end_token, key, tiering_extra, token_range


def test_coverage_mismatch_chunk_never_stored(managers: list, caplog: pytest.LogCaptureFixture) -> None:
    m = observed(managers, cpu_extra(4))
    a = ctx(m, "req-a", {key(1): 16, key(7, group=2): 32})
    store(m, [key(1)], a)
    assert m.lookup(key(1), a) is LookupResult.HIT
    with caplog.at_level(logging.ERROR, logger="kvobs"):
        match = failed_load(m, [key(1), key(7, group=2)], a)
    assert match["cause"] == "coverage_mismatch"
    assert (match["group"], match["req"], match["missing"], match["total"]) == ("2", "req-a", "1", "2")
    assert match["listed"] == f"[({end_token(32)}, None)]" and match["range"] == token_range("16-32")
    assert "never reported" in match["evidence"]
    assert [r.message for r in caplog.records if r.name == "kvobs"].__len__() == 1
    assert +m.observer.failures == {"coverage_mismatch": 1}


def test_evicted_after_lookup_by_another_requests_store(managers: list) -> None:
    m = observed(managers, cpu_extra(2))
    a = ctx(m, "req-a", {key(1): 1024})
    b = ctx(m, "req-b")
    store(m, [key(1), key(2)], a)
    assert m.lookup(key(1), a) is LookupResult.HIT
    store(m, [key(3), key(4)], b)  # capacity eviction of key(1), key(2)
    match = failed_load(m, [key(1)], a)
    assert match["cause"] == "evicted_after_lookup"
    assert match["listed"].startswith(f"[({end_token(1024)}, 0.0") and match["range"] == token_range("1024-1024")
    assert match["hist"] == "2"
    assert "capacity removal" in match["evidence"] and "path=store" in match["evidence"]
    assert "req_id='req-b'" in match["evidence"]
    assert +m.observer.near_misses == {"capacity": 1}


def test_evicted_after_lookup_by_a_tiering_promotion_inside_lookup(managers: list) -> None:
    m = observed(managers, tiering_extra(1))
    s1, s2 = ctx(m, "store-1"), ctx(m, "store-2")
    store(m, [key(1)], s1)
    m.on_schedule_end(END)  # cascade of key(1) to the secondary tier completes
    store(m, [key(2)], s2)  # evicts key(1) from the primary tier; it stays in the secondary
    m.on_schedule_end(END)
    a = ctx(m, "req-a", {key(2): 32, key(1): 16})
    assert m.lookup(key(2), a) is LookupResult.HIT
    assert m.lookup(key(1), a) is LookupResult.HIT_PENDING  # promotion evicts key(2)
    match = failed_load(m, [key(2)], a)
    assert match["cause"] == "evicted_after_lookup"
    assert "path=lookup" in match["evidence"] and "req_id='req-a'" in match["evidence"]
    assert m.observer.near_misses["capacity"] == 1


def test_the_cause_is_the_first_removal_after_the_lookup_not_the_last(managers: list) -> None:
    """Evicted after req-c's lookup, stored again by req-d, whose store then fails: req-c's chunk
    was lost to the capacity eviction (what its near miss says too); the failed store came later."""
    m = observed(managers, cpu_extra(2))
    c, b, d = ctx(m, "req-c", {key(1): 16}), ctx(m, "req-b"), ctx(m, "req-d")
    store(m, [key(1), key(2)], c)
    assert m.lookup(key(1), c) is LookupResult.HIT
    store(m, [key(3), key(4)], b)  # capacity eviction of key(1)
    m.complete_load([], b)
    store(m, [key(1)], d, complete=False)  # req-d stores key(1) again...
    m.complete_store([key(1)], d, False)  # ...and that store fails: removed again
    match = failed_load(m, [key(1)], c)
    assert match["cause"] == "evicted_after_lookup", match["evidence"]
    assert "capacity removal" in match["evidence"] and "req_id='req-b'" in match["evidence"]
    assert "removed again since: store_failed" in match["evidence"] and "req_id='req-d'" in match["evidence"]
    assert +m.observer.near_misses == {"capacity": 1}
    assert +m.observer.failures == {"evicted_after_lookup": 1}


def test_store_in_flight(managers: list) -> None:
    m = observed(managers, cpu_extra(4))
    a = ctx(m, "req-a")
    store(m, [key(1)], a, complete=False)
    assert m.lookup(key(1), a) is LookupResult.HIT_PENDING
    match = failed_load(m, [key(1)], a)
    assert match["cause"] == "store_in_flight"
    assert str(match.string).startswith(f"Chunk {key(1)!r} is not ready for reading")


@pytest.mark.parametrize("extra", [cpu_extra(4), tiering_extra(4)], ids=["cpu", "tiering"])
def test_reset_after_lookup(managers: list, extra: dict[str, Any]) -> None:
    m = observed(managers, extra)
    a = ctx(m, "req-a", {key(1): 16})
    store(m, [key(1)], a)
    m.on_schedule_end(END)
    assert m.lookup(key(1), a) is LookupResult.HIT
    m.reset_cache()
    match = failed_load(m, [key(1)], a)
    assert match["cause"] == "reset_after_lookup"
    assert "reset" in match["evidence"]
    assert m.observer.evicted["reset"] == 1 and +m.observer.near_misses == {"reset": 1}


def promoting(m: ObservedOffloadingManager) -> ReqContext:
    """A one-chunk CPU tier: key(1) stored, pushed to the secondary tier by key(2), then looked up by
    req-a, whose lookup starts its promotion (HIT_PENDING: the CPU slot allocated, the write pending)."""
    s1, s2 = ctx(m, "store-1"), ctx(m, "store-2")
    store(m, [key(1)], s1)
    m.on_schedule_end(END)
    store(m, [key(2)], s2)  # key(1) now only in the secondary tier
    m.on_schedule_end(END)
    a = ctx(m, "req-a", {key(1): 16})
    assert m.lookup(key(1), a) is LookupResult.HIT_PENDING
    return a


def test_store_failed_after_lookup_a_failed_promotion(managers: list) -> None:
    m = observed(managers, tiering_extra(1))
    tier = m.inner.secondary_tiers[0]
    a = promoting(m)
    del tier.chunks[key(1)]  # the object vanished from the tier: its read (submit_load) fails
    m.on_schedule_end(END)  # flush submits the promotion; the tier fails it
    m.on_schedule_end(END)  # the failure is processed: complete_write(success=False)
    match = failed_load(m, [key(1)], a)
    assert match["cause"] == "store_failed_after_lookup"
    assert "store_failed removal" in match["evidence"] and "HIT_PENDING" in match["evidence"]
    assert m.observer.evicted["store_failed"] == 1


def test_store_failed_after_lookup_a_promotion_released_later(managers: list) -> None:
    """vLLM 0.34: a tier fails a promotion with its I/O still in flight (``JobResult.deferred_release``);
    tiering drops the keys and holds their slots (``defer_write_release``). The removal has a reason of
    its own, ``deferred_release``; the load's cause is a failed write. Before 0.34 a tier cannot say so."""
    from vllm.v1.kv_offload.tiering.base import JobResult

    if "deferred_release" not in JobResult.__dataclass_fields__:  # 0.30-0.33: no such path to hook
        tier = compat.cpu_tier_of(observed(managers, tiering_extra(1)).inner)
        assert not hasattr(tier, compat.DEFERRED_RELEASE_METHOD)
        return
    m = observed(managers, {**tiering_extra(1), "secondary_tiers": [{"type": "DeferringTier",
                                                                     "module_path": "tests.support.flaky_tier"}]})
    a = promoting(m)
    m.on_schedule_end(END)  # flush submits the promotion; the tier fails it, release deferred
    m.on_schedule_end(END)  # the failure is processed: defer_write_release
    match = failed_load(m, [key(1)], a)
    assert match["cause"] == "store_failed_after_lookup"
    assert "deferred_release removal" in match["evidence"] and "HIT_PENDING" in match["evidence"]
    # key(2)'s store evicted key(1), the promotion's allocation key(2); the failed promotion is no eviction
    assert +m.observer.evicted == {"capacity": 2, "deferred_release": 1}
    for event in m.inner.secondary_tiers[0].released:
        event.set()


def test_unknown_when_the_history_is_too_small(managers: list) -> None:
    m = observed(managers, cpu_extra(4), history_size=1024)
    a = ctx(m, "req-a", {key(1): 16})
    churn = ctx(m, "churn")
    store(m, [key(1)], a)
    assert m.lookup(key(1), a) is LookupResult.HIT
    for i in range(300):  # 1,200 newer removals push key(1)'s out of a 1,024-key history
        store(m, [key(1000 + 4 * i + j) for j in range(4)], churn)
    match = failed_load(m, [key(1)], a)
    assert match["cause"] == "unknown"
    assert match["listed"] == f"[({end_token(16)}, None)]" and match["hist"] == "1024"
    assert "older than the history" in match["evidence"]


def test_near_miss_counted_when_the_load_then_succeeds(managers: list) -> None:
    m = observed(managers, cpu_extra(2))
    a, b, c = ctx(m, "req-a"), ctx(m, "req-b"), ctx(m, "req-c")
    store(m, [key(1), key(2)], a)
    assert m.lookup(key(1), a) is LookupResult.HIT
    store(m, [key(3), key(4)], b)  # key(1) evicted after req-a's lookup
    m.complete_load([], b)
    store(m, [key(1)], c)  # ...and stored again before req-a's load
    m.prepare_load([key(1)], a)  # no assertion
    assert +m.observer.near_misses == {"capacity": 1}
    assert not +m.observer.failures
    # Once pinned, later evictions of the request's chunks are not near misses.
    m.complete_load([key(1)], a)
    store(m, [key(5), key(6)], b)
    assert +m.observer.near_misses == {"capacity": 1}


def test_kvobs_internal_fault_never_changes_the_assertion(managers: list, monkeypatch: pytest.MonkeyPatch) -> None:
    m = observed(managers, cpu_extra(2))
    a = ctx(m, "req-a")

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("kvobs bug")

    monkeypatch.setattr(m.observer, "load_failed", broken)
    with pytest.raises(AssertionError) as info:
        m.prepare_load([key(9)], a)
    assert str(info.value) == f"Chunk {key(9)!r} not found in cache"
    assert +m.observer.internal_errors == {"diagnosis": 1}


@pytest.mark.parametrize("evictions", [100, 300, 700, 1000, 1500])
def test_the_near_miss_and_the_cause_agree_however_many_evictions_follow(managers: list, evictions: int) -> None:
    """One rule over one evidence (issue 21): the failed load's cause and its near miss come from the
    same first removal after the lookup, whether the hot path still remembers it or only the history
    does; once the history has lost it too (1,500), both say so alike: cause unknown, no near miss."""
    m = observed(managers, cpu_extra(4), history_size=1024)
    a = ctx(m, "req-a", {key(1): 16})
    churn = ctx(m, "churn")
    store(m, [key(1)], a)
    assert m.lookup(key(1), a) is LookupResult.HIT
    for i in range(evictions + 3):  # one key a store: each store past the 4th evicts one chunk
        store(m, [key(1000 + i)], churn)
    match = failed_load(m, [key(1)], a)
    if evictions <= 1000:
        assert match["cause"] == "evicted_after_lookup" and +m.observer.failures == {"evicted_after_lookup": 1}
        assert +m.observer.near_misses == {"capacity": 1}
    else:
        assert match["cause"] == "unknown" and "older than the history" in match["evidence"]
        assert not +m.observer.near_misses


def test_a_near_miss_long_after_the_lookup_is_counted_when_the_load_succeeds(managers: list) -> None:
    """700 evictions between the lookup and a load that succeeds (the chunk was stored again): one near
    miss, counted once, whatever the hot path's short memory of removals has forgotten."""
    m = observed(managers, cpu_extra(4), history_size=1024)
    a, churn, c = ctx(m, "req-a"), ctx(m, "churn"), ctx(m, "req-c")
    store(m, [key(1)], a)
    assert m.lookup(key(1), a) is LookupResult.HIT
    for i in range(703):
        store(m, [key(1000 + i)], churn)
    store(m, [key(1)], c)  # stored again before req-a's load
    m.prepare_load([key(1)], a)
    m.complete_load([key(1)], a)
    m.prepare_load([key(1)], a)  # the same removal is not counted twice
    assert +m.observer.near_misses == {"capacity": 1} and not +m.observer.failures
