# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# vLLM v0.34.0 (commit 62d4bc3c7), tests/v1/kv_offload/cpu/test_manager.py, vendored unchanged
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pytest

from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingMetrics
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy


def make_req_context(
    req_id: str = "", kv_transfer_params: dict | None = None
) -> ReqContext:
    """Create a ReqContext as production code would, from a request's params."""
    return ReqContext(req_id=req_id, kv_transfer_params=kv_transfer_params)


_EMPTY_REQ_CTX = make_req_context()


def make_cpu_manager(
    num_chunks: int = 4,
    cache_policy: str = "lru",
    cache_policy_module_path: str | None = None,
    enable_events: bool = False,
    store_threshold: int = 0,
    max_tracker_size: int = 64_000,
) -> CPUOffloadingManager:
    return CPUOffloadingManager(
        num_chunks=num_chunks,
        cache_policy=cache_policy,
        cache_policy_module_path=cache_policy_module_path,
        enable_events=enable_events,
        store_threshold=store_threshold,
        max_tracker_size=max_tracker_size,
    )


@dataclass
class ExpectedPrepareStoreOutput:
    keys_to_store: list[int]
    store_chunk_ids: list[int]
    evicted_keys: list[int]


class _CountingOrderedDict(OrderedDict):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.items_yielded = 0

    def items(self):
        for item in super().items():
            self.items_yielded += 1
            yield item


def to_key(int_hash: int) -> OffloadKey:
    return make_offload_key(str(int_hash).encode(), 0)


def to_keys(int_hashes: list[int]) -> list[OffloadKey]:
    return [to_key(i) for i in int_hashes]


def reuse_keys(manager: CPUOffloadingManager, keys: list[OffloadKey]) -> None:
    """Load ready keys in one finished request, recording a single access."""
    ctx = make_req_context("reuse")
    manager.prepare_load(keys, ctx)
    manager.complete_load(keys, ctx)
    manager.on_request_finished(ctx)


def verify_store_output(
    prepare_store_output: PrepareStoreOutput | None,
    expected_prepare_store_output: ExpectedPrepareStoreOutput,
):
    assert prepare_store_output is not None
    assert prepare_store_output.keys_to_store == to_keys(
        expected_prepare_store_output.keys_to_store
    )
    assert prepare_store_output.evicted_keys == to_keys(
        expected_prepare_store_output.evicted_keys
    )
    store_spec = prepare_store_output.store_spec
    assert isinstance(store_spec, CPULoadStoreSpec)
    expected_array = np.array(
        expected_prepare_store_output.store_chunk_ids, dtype=np.int64
    )
    assert np.array_equal(expected_array, store_spec.chunk_ids)


def verify_load_output(
    prepare_load_output: LoadStoreSpec, expected_prepare_load_output: list[int]
):
    assert isinstance(prepare_load_output, CPULoadStoreSpec)
    expected_array = np.array(expected_prepare_load_output, dtype=np.int64)
    assert np.array_equal(expected_array, prepare_load_output.chunk_ids)


def check_split_usage_stats(
    manager: CPUOffloadingManager, write: float, read: float, total: float
):
    stats = manager.get_stats()
    assert stats is not None
    reduced = stats.reduce()
    assert reduced[CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC] == pytest.approx(
        write
    )
    assert reduced[CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC] == pytest.approx(
        read
    )
    assert reduced[CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC] == pytest.approx(total)


def verify_events(
    events: Iterable[OffloadingEvent],
    expected_stores: tuple[set[int], ...] = (),
    expected_evictions: tuple[set[int], ...] = (),
):
    stores: list[set[OffloadKey]] = []
    evictions: list[set[OffloadKey]] = []
    for event in events:
        assert event.medium == Medium.CPU
        if event.removed:
            evictions.append(set(event.keys))
        else:
            stores.append(set(event.keys))

    def to_key_sets(
        int_sets: tuple[set[int], ...],
    ) -> tuple[set[OffloadKey], ...]:
        return tuple([set(to_keys(list(int_set))) for int_set in int_sets])

    assert tuple(evictions) == to_key_sets(expected_evictions)
    assert tuple(stores) == to_key_sets(expected_stores)


def test_cpu_stored_event_carries_request_context():
    manager = CPUOffloadingManager(
        num_chunks=1,
        enable_events=True,
    )
    req_context = make_req_context("writer")
    keys = to_keys([1])
    assert manager.prepare_store(keys, req_context) is not None
    manager.complete_store(keys, req_context)

    [event] = manager.take_events()
    assert event.req_context is req_context


def test_cpu_eviction_removed_precedes_stored():
    """An eviction is announced before the store that reuses its capacity."""
    manager = make_cpu_manager(num_chunks=2, enable_events=True)

    manager.prepare_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
    manager.complete_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
    list(manager.take_events())

    manager.prepare_store(to_keys([3]), _EMPTY_REQ_CTX)
    manager.complete_store(to_keys([3]), _EMPTY_REQ_CTX)

    events = list(manager.take_events())
    removed_idx = [i for i, event in enumerate(events) if event.removed]
    stored_idx = [i for i, event in enumerate(events) if not event.removed]
    assert removed_idx and stored_idx, events
    assert max(removed_idx) < min(stored_idx)
    assert all(event.medium == manager.medium for event in events)


@pytest.mark.parametrize("eviction_policy", ["lru", "arc"])
def test_already_stored_chunk_not_evicted_during_prepare_store(eviction_policy):
    """Regression test: a chunk that is already stored must not be evicted
    by prepare_store() when it needs to make room for new chunks.
    Applies to both lru and arc policies.

    Scenario:
        - Store chunks [1, 2] and complete.
        - Reusing [1] makes chunk 2 the LRU candidate.
        - prepare_store([2, 3, 4, 5]):
            * chunk 2 is filtered out as "already stored"
            * but without the fix, chunk 2 would be evicted as the LRU
              candidate to make room for [3, 4, 5]
        - After complete_store([2, 3, 4, 5]), chunk 2 must still be present.
    """
    manager = make_cpu_manager(
        num_chunks=4,
        cache_policy=eviction_policy,
        enable_events=True,
    )

    # store [1, 2] and complete
    manager.prepare_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
    manager.complete_store(to_keys([1, 2]), _EMPTY_REQ_CTX)

    # reuse [1] to make chunk 2 the LRU candidate
    reuse_keys(manager, to_keys([1]))

    # prepare_store([2, 3, 4, 5]):
    #   - chunk 2 is already stored -> filtered out of keys_to_store
    #   - chunk 2 must NOT be evicted even though it is the LRU candidate
    #   - chunk 1 (ID 0) is evicted instead; new chunks [3,4,5] get IDs 2,3,0
    prepare_store_output = manager.prepare_store(to_keys([2, 3, 4, 5]), _EMPTY_REQ_CTX)
    verify_store_output(
        prepare_store_output,
        ExpectedPrepareStoreOutput(
            keys_to_store=[3, 4, 5],
            store_chunk_ids=[2, 3, 0],
            evicted_keys=[1],  # chunk 1 evicted, not chunk 2
        ),
    )

    # complete_store must not silently drop chunk 2
    manager.complete_store(to_keys([2, 3, 4, 5]), _EMPTY_REQ_CTX)

    # chunk 2 must still be present in the cache
    assert manager.lookup(to_key(2), _EMPTY_REQ_CTX) is LookupResult.HIT


def test_filter_reused_manager_reports_stores_skipped_counter():
    manager = make_cpu_manager(
        num_chunks=4,
        cache_policy="lru",
        store_threshold=2,
    )

    prepare_store_output = manager.prepare_store(to_keys([1, 2, 3]), _EMPTY_REQ_CTX)

    verify_store_output(
        prepare_store_output,
        ExpectedPrepareStoreOutput(
            keys_to_store=[],
            store_chunk_ids=[],
            evicted_keys=[],
        ),
    )
    stats = manager.get_stats()
    assert stats is not None
    assert stats.reduce()[CPUOffloadingMetrics.STORES_SKIPPED] == 3
    stats = manager.get_stats()
    assert stats is not None
    assert stats.reduce()[CPUOffloadingMetrics.STORES_SKIPPED] == 0


def test_cpu_manager_reports_no_config_info_without_info():
    """A caller that passes no info keeps the empty default.

    The scheduler still sends an info payload, so the metric appears with the
    engine labels alone. Tests in tests/v1/kv_offload/test_factory.py cover the
    published labels, because a real spec supplies the info.
    """
    manager = make_cpu_manager(num_chunks=4)

    assert manager.config_info() == [{}]


def test_cpu_manager_reports_cache_usage_gauge():
    def check_usage_stats(manager: CPUOffloadingManager, value: float):
        stats = manager.get_stats()
        assert stats is not None
        assert stats.reduce()[
            CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC
        ] == pytest.approx(value)

    # Zero-capacity manager always reports 0.0
    manager = make_cpu_manager(num_chunks=0)
    check_usage_stats(manager, 0.0)

    # Empty manager (4 chunks, none allocated): usage = 0.0
    manager = make_cpu_manager(num_chunks=4)
    check_usage_stats(manager, 0.0)

    # After allocating 2 of 4 chunks: usage = 0.5
    manager.prepare_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
    check_usage_stats(manager, 0.5)

    # After filling all 4 chunks: usage = 1.0
    manager.prepare_store(to_keys([3, 4]), _EMPTY_REQ_CTX)
    check_usage_stats(manager, 1.0)

    # After completing store, the chunks become evictable as not actively used
    # and usage drops.
    manager.complete_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
    check_usage_stats(manager, 0.5)

    # After completing store, the chunks become evictable as not actively used
    # and usage drops.
    manager.complete_store(to_keys([3, 4]), _EMPTY_REQ_CTX)
    check_usage_stats(manager, 0.0)


def test_cpu_manager_reports_allocation_size_histogram():
    manager = make_cpu_manager(num_chunks=4, cache_policy="lru")

    manager.prepare_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
    manager.complete_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
    manager.prepare_store(to_keys([1, 2, 3]), _EMPTY_REQ_CTX)

    stats = manager.get_stats()

    assert stats is not None
    reduced = stats.reduce()
    assert reduced[f"{CPUOffloadingMetrics.CPU_ALLOCATION_SIZE}_count"] == 2
    assert reduced[f"{CPUOffloadingMetrics.CPU_ALLOCATION_SIZE}_sum"] == 3

    # The cache-usage gauge is always reported, so get_stats() never returns
    # None, but the histogram has nothing new once its samples are consumed.
    second_stats = manager.get_stats()
    assert second_stats is not None
    assert f"{CPUOffloadingMetrics.CPU_ALLOCATION_SIZE}_count" not in (
        second_stats.reduce()
    )


def test_cpu_manager_reports_allocation_size_on_allocation_failure(monkeypatch):
    manager = make_cpu_manager(num_chunks=4, cache_policy="lru")

    def fail_allocate_chunks(keys):
        raise RuntimeError("allocation failed")

    monkeypatch.setattr(manager, "_allocate_chunks", fail_allocate_chunks)

    with pytest.raises(RuntimeError, match="allocation failed"):
        manager.prepare_store(to_keys([1, 2, 3]), _EMPTY_REQ_CTX)

    stats = manager.get_stats()

    assert stats is not None
    reduced = stats.reduce()
    assert reduced[f"{CPUOffloadingMetrics.CPU_ALLOCATION_SIZE}_count"] == 1
    assert reduced[f"{CPUOffloadingMetrics.CPU_ALLOCATION_SIZE}_sum"] == 3


def test_cpu_manager_reports_allocation_size_on_eviction_failure():
    manager = make_cpu_manager(num_chunks=1, cache_policy="lru")

    manager.prepare_store(to_keys([1]), _EMPTY_REQ_CTX)
    manager.get_stats()

    assert manager.prepare_store(to_keys([2]), _EMPTY_REQ_CTX) is None

    stats = manager.get_stats()

    assert stats is not None
    reduced = stats.reduce()
    assert reduced[f"{CPUOffloadingMetrics.CPU_ALLOCATION_SIZE}_count"] == 1
    assert reduced[f"{CPUOffloadingMetrics.CPU_ALLOCATION_SIZE}_sum"] == 1


def test_cpu_manager_reports_cache_write_and_read_usage_gauges():
    manager = make_cpu_manager(num_chunks=4)

    # Store path: pins write usage until complete_store.
    manager.prepare_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
    check_split_usage_stats(manager, write=0.5, read=0.0, total=0.5)

    manager.complete_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
    check_split_usage_stats(manager, write=0.0, read=0.0, total=0.0)

    # Load path: pins read usage until complete_load.
    assert manager.lookup(to_key(1), _EMPTY_REQ_CTX) is LookupResult.HIT
    manager.prepare_load(to_keys([1]), _EMPTY_REQ_CTX)
    check_split_usage_stats(manager, write=0.0, read=0.25, total=0.25)

    manager.complete_load(to_keys([1]), _EMPTY_REQ_CTX)
    check_split_usage_stats(manager, write=0.0, read=0.0, total=0.0)

    # Concurrent write + read pins are both reflected and additive.
    manager.prepare_store(to_keys([3, 4]), _EMPTY_REQ_CTX)
    manager.prepare_load(to_keys([2]), _EMPTY_REQ_CTX)
    check_split_usage_stats(manager, write=0.5, read=0.25, total=0.75)


def test_cpu_manager_clears_write_usage_after_failed_store():
    manager = make_cpu_manager(num_chunks=4)

    manager.prepare_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
    check_split_usage_stats(manager, write=0.5, read=0.0, total=0.5)

    manager.complete_store(to_keys([1, 2]), _EMPTY_REQ_CTX, success=False)
    check_split_usage_stats(manager, write=0.0, read=0.0, total=0.0)


def test_cpu_manager():
    """Tests CPUOffloadingManager with lru policy."""
    # initialize a CPU manager with a capacity of 4 chunks
    cpu_manager = make_cpu_manager(num_chunks=4, cache_policy="lru", enable_events=True)

    # prepare store [1, 2]
    prepare_store_output = cpu_manager.prepare_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
    verify_store_output(
        prepare_store_output,
        ExpectedPrepareStoreOutput(
            keys_to_store=[1, 2],
            store_chunk_ids=[0, 1],
            evicted_keys=[],
        ),
    )

    # lookup [1, 2] -> write in-flight, not yet ready
    assert cpu_manager.lookup(to_key(1), _EMPTY_REQ_CTX) is LookupResult.HIT_PENDING
    assert cpu_manager.lookup(to_key(2), _EMPTY_REQ_CTX) is LookupResult.HIT_PENDING

    # no events so far
    assert list(cpu_manager.take_events()) == []

    # complete store [1, 2]
    cpu_manager.complete_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
    verify_events(cpu_manager.take_events(), expected_stores=({1, 2},))

    # lookup [1, 2]
    assert cpu_manager.lookup(to_key(1), _EMPTY_REQ_CTX) is LookupResult.HIT
    assert cpu_manager.lookup(to_key(2), _EMPTY_REQ_CTX) is LookupResult.HIT
    assert cpu_manager.lookup(to_key(3), _EMPTY_REQ_CTX) is LookupResult.MISS

    # prepare store [2, 3, 4, 5] -> evicts [1]
    prepare_store_output = cpu_manager.prepare_store(
        to_keys([2, 3, 4, 5]), _EMPTY_REQ_CTX
    )
    verify_store_output(
        prepare_store_output,
        ExpectedPrepareStoreOutput(
            keys_to_store=[3, 4, 5],
            store_chunk_ids=[2, 3, 0],
            evicted_keys=[1],
        ),
    )

    # verify eviction event
    verify_events(cpu_manager.take_events(), expected_evictions=({1},))

    # prepare store with no space
    assert cpu_manager.prepare_store(to_keys([1, 6]), _EMPTY_REQ_CTX) is None

    # complete store [2, 3, 4, 5]
    cpu_manager.complete_store(to_keys([2, 3, 4, 5]), _EMPTY_REQ_CTX)

    # lookup (now that we have [2, 3, 4, 5])
    assert cpu_manager.lookup(to_key(1), _EMPTY_REQ_CTX) is LookupResult.MISS
    assert cpu_manager.lookup(to_key(2), _EMPTY_REQ_CTX) is LookupResult.HIT
    assert cpu_manager.lookup(to_key(3), _EMPTY_REQ_CTX) is LookupResult.HIT
    assert cpu_manager.lookup(to_key(4), _EMPTY_REQ_CTX) is LookupResult.HIT
    assert cpu_manager.lookup(to_key(5), _EMPTY_REQ_CTX) is LookupResult.HIT
    assert cpu_manager.lookup(to_key(0), _EMPTY_REQ_CTX) is LookupResult.MISS

    # prepare load [2, 3]
    load_ctx = make_req_context("load-2-3")
    prepare_load_output = cpu_manager.prepare_load(to_keys([2, 3]), load_ctx)
    verify_load_output(prepare_load_output, [1, 2])

    # prepare store with no space ([2, 3] is being loaded)
    assert cpu_manager.prepare_store(to_keys([6, 7, 8]), _EMPTY_REQ_CTX) is None

    # complete load [2, 3]. Load changes the eviction list, making 2, 3 recent.
    cpu_manager.complete_load(to_keys([2, 3]), load_ctx)
    cpu_manager.on_request_finished(load_ctx)

    # prepare store [6, 7, 8] -> evicts [4, 5, 3] (oldest). Within
    # the accessed prefix [2, 3], the tail is less valuable than the head.
    prepare_store_output = cpu_manager.prepare_store(to_keys([6, 7, 8]), _EMPTY_REQ_CTX)
    verify_store_output(
        prepare_store_output,
        ExpectedPrepareStoreOutput(
            keys_to_store=[6, 7, 8],
            store_chunk_ids=[2, 0, 3],
            evicted_keys=[4, 5, 3],
        ),
    )

    # complete store [6, 7, 8]
    cpu_manager.complete_store(to_keys([6, 7, 8]), _EMPTY_REQ_CTX)

    # reuse [2, 6, 7] (move to end of LRU order)
    reuse_keys(cpu_manager, to_keys([2, 6, 7]))

    # prepare store [7, 9] -> evicts [8] (oldest following previous reuse)
    prepare_store_output = cpu_manager.prepare_store(to_keys([9]), _EMPTY_REQ_CTX)
    verify_store_output(
        prepare_store_output,
        ExpectedPrepareStoreOutput(
            keys_to_store=[9],
            store_chunk_ids=[3],
            evicted_keys=[8],
        ),
    )

    # complete store [7, 9] with failure
    cpu_manager.complete_store(to_keys([7, 9]), _EMPTY_REQ_CTX, success=False)

    # assert [7] is still stored, but [9] is not
    assert cpu_manager.lookup(to_key(7), _EMPTY_REQ_CTX) is LookupResult.HIT
    assert cpu_manager.lookup(to_key(9), _EMPTY_REQ_CTX) is LookupResult.MISS

    verify_events(
        cpu_manager.take_events(),
        expected_stores=({3, 4, 5}, {6, 7, 8}),
        expected_evictions=({4, 5, 3}, {8}, {9}),
    )


def test_prepare_load_preserves_key_order():
    """chunk_ids[i] must correspond to keys[i] (co-indexed invariant)."""
    manager = make_cpu_manager(num_chunks=4, cache_policy="lru")

    key_a, key_b, key_c = to_key(0), to_key(1), to_key(2)

    # Store all three keys and learn their chunk ID assignments
    store_output = manager.prepare_store([key_a, key_b, key_c], _EMPTY_REQ_CTX)
    assert store_output is not None
    assert isinstance(store_output.store_spec, CPULoadStoreSpec)
    key_to_chunk_id = {
        k: int(cid)
        for k, cid in zip(store_output.keys_to_store, store_output.store_spec.chunk_ids)
    }
    manager.complete_store([key_a, key_b, key_c], _EMPTY_REQ_CTX)

    # Forward order: [a, b, c]
    spec_fwd = manager.prepare_load([key_a, key_b, key_c], _EMPTY_REQ_CTX)
    assert isinstance(spec_fwd, CPULoadStoreSpec)
    assert [int(x) for x in spec_fwd.chunk_ids] == [
        key_to_chunk_id[key_a],
        key_to_chunk_id[key_b],
        key_to_chunk_id[key_c],
    ]
    manager.complete_load([key_a, key_b, key_c], _EMPTY_REQ_CTX)  # order irrelevant

    # Arbitrary permutation: [b, c, a]
    spec_perm = manager.prepare_load([key_b, key_c, key_a], _EMPTY_REQ_CTX)
    assert isinstance(spec_perm, CPULoadStoreSpec)
    assert [int(x) for x in spec_perm.chunk_ids] == [
        key_to_chunk_id[key_b],
        key_to_chunk_id[key_c],
        key_to_chunk_id[key_a],
    ]
    manager.complete_load([key_a, key_b, key_c], _EMPTY_REQ_CTX)  # order irrelevant


def test_lru_batch_eviction_failure_is_atomic():
    manager = make_cpu_manager(num_chunks=4, cache_policy="lru")
    policy = manager._policy
    assert isinstance(policy, LRUCachePolicy)
    keys = to_keys([1, 2, 3, 4])
    assert manager.prepare_store(keys, _EMPTY_REQ_CTX) is not None
    manager.complete_store(keys, _EMPTY_REQ_CTX)

    protected = set(keys[1:])
    assert policy.evict(2, protected) is None
    assert all(manager.lookup(key, _EMPTY_REQ_CTX) is LookupResult.HIT for key in keys)

    evicted = policy.evict(1, protected)
    assert evicted is not None
    assert [key for key, _ in evicted] == [keys[0]]


def test_lru_repeated_pin_cycles_compact_lazy_heap_entries():
    manager = make_cpu_manager(num_chunks=1, cache_policy="lru")
    policy = manager._policy
    assert isinstance(policy, LRUCachePolicy)
    key = to_key(1)
    assert manager.prepare_store([key], _EMPTY_REQ_CTX) is not None
    manager.complete_store([key], _EMPTY_REQ_CTX)

    for _ in range(128):
        manager.prepare_load([key], _EMPTY_REQ_CTX)
        manager.complete_load([key], _EMPTY_REQ_CTX)

    assert len(policy._heap) < 64
    evicted = policy.evict(1, set())
    assert evicted is not None
    assert [evicted_key for evicted_key, _ in evicted] == [key]


def test_reset_discards_stale_request_access_classification():
    manager = make_cpu_manager(num_chunks=1, cache_policy="arc")
    policy = manager._policy
    assert isinstance(policy, ARCCachePolicy)
    key = to_key(1)
    resumed_ctx = make_req_context("resumed")

    assert manager.prepare_store([key], resumed_ctx) is not None
    manager.complete_store([key], resumed_ctx)
    manager.reset_cache()

    replacement_ctx = make_req_context("replacement")
    assert manager.prepare_store([key], replacement_ctx) is not None
    manager.complete_store([key], replacement_ctx)
    manager.on_request_finished(replacement_ctx)
    assert key in policy.t1

    manager.prepare_load([key], resumed_ctx)
    manager.complete_load([key], resumed_ctx)
    manager.on_request_finished(resumed_ctx)

    assert key in policy.t2


class TestARCPolicy:
    """Unit tests for CPUOffloadingManager with ARC eviction policy."""

    def _make_manager(
        self, num_chunks: int = 4, enable_events: bool = True
    ) -> tuple[CPUOffloadingManager, ARCCachePolicy]:
        manager = make_cpu_manager(
            num_chunks=num_chunks,
            cache_policy="arc",
            enable_events=enable_events,
        )
        policy = manager._policy
        assert isinstance(policy, ARCCachePolicy)
        return manager, policy

    def test_basic(self):
        """Tests CPUOffloadingManager with arc policy.
        Verifies that ARC handles store, load, and lookup operations correctly.
        """
        cpu_manager, arc_policy = self._make_manager()

        # prepare store [1, 2]
        prepare_store_output = cpu_manager.prepare_store(
            to_keys([1, 2]), _EMPTY_REQ_CTX
        )
        verify_store_output(
            prepare_store_output,
            ExpectedPrepareStoreOutput(
                keys_to_store=[1, 2],
                store_chunk_ids=[0, 1],
                evicted_keys=[],
            ),
        )

        # lookup [1, 2] -> write in-flight, not yet ready
        assert cpu_manager.lookup(to_key(1), _EMPTY_REQ_CTX) is LookupResult.HIT_PENDING
        assert cpu_manager.lookup(to_key(2), _EMPTY_REQ_CTX) is LookupResult.HIT_PENDING

        # no events so far
        assert list(cpu_manager.take_events()) == []

        # complete store [1, 2]
        cpu_manager.complete_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
        verify_events(cpu_manager.take_events(), expected_stores=({1, 2},))

        # lookup [1, 2]
        assert cpu_manager.lookup(to_key(1), _EMPTY_REQ_CTX) is LookupResult.HIT
        assert cpu_manager.lookup(to_key(2), _EMPTY_REQ_CTX) is LookupResult.HIT
        assert cpu_manager.lookup(to_key(3), _EMPTY_REQ_CTX) is LookupResult.MISS

        # chunks should be in T1 (recent)
        assert len(arc_policy.t1) == 2
        assert len(arc_policy.t2) == 0

    def test_t1_to_t2_promotion(self):
        """Tests that accessing a chunk in T1 promotes it to T2 (frequent).
        This is a key feature of ARC's adaptive behavior.
        """
        cpu_manager, arc_policy = self._make_manager(enable_events=False)

        # store and complete chunk 1
        cpu_manager.prepare_store(to_keys([1]), _EMPTY_REQ_CTX)
        cpu_manager.complete_store(to_keys([1]), _EMPTY_REQ_CTX)

        # chunk 1 starts in T1 (recent)
        assert to_keys([1])[0] in arc_policy.t1
        assert to_keys([1])[0] not in arc_policy.t2

        # reuse chunk 1 (second access)
        reuse_keys(cpu_manager, to_keys([1]))

        # chunk 1 should now be in T2 (frequent)
        assert to_keys([1])[0] not in arc_policy.t1
        assert to_keys([1])[0] in arc_policy.t2

    def test_eviction_with_load(self):
        """Tests ARC eviction behavior similar to LRU test.
        Verifies that chunks being loaded (ref_cnt > 0) cannot be evicted.
        """
        cpu_manager, _ = self._make_manager()

        # prepare and complete store [1, 2, 3, 4]
        prepare_store_output = cpu_manager.prepare_store(
            to_keys([1, 2, 3, 4]), _EMPTY_REQ_CTX
        )
        verify_store_output(
            prepare_store_output,
            ExpectedPrepareStoreOutput(
                keys_to_store=[1, 2, 3, 4],
                store_chunk_ids=[0, 1, 2, 3],
                evicted_keys=[],
            ),
        )
        cpu_manager.complete_store(to_keys([1, 2, 3, 4]), _EMPTY_REQ_CTX)

        # prepare load [2, 3] (increases ref_cnt)
        prepare_load_output = cpu_manager.prepare_load(to_keys([2, 3]), _EMPTY_REQ_CTX)
        verify_load_output(prepare_load_output, [1, 2])

        # prepare store [5, 6, 7] with [2, 3] being loaded
        # should fail because [2, 3] have ref_cnt > 0
        assert cpu_manager.prepare_store(to_keys([5, 6, 7]), _EMPTY_REQ_CTX) is None

        # complete load [2, 3]
        cpu_manager.complete_load(to_keys([2, 3]), _EMPTY_REQ_CTX)

        # now prepare store [5, 6, 7] should succeed
        # ARC will evict chunks one at a time from T1 as needed
        prepare_store_output = cpu_manager.prepare_store(
            to_keys([5, 6, 7]), _EMPTY_REQ_CTX
        )
        assert prepare_store_output is not None
        # Should successfully evict enough chunks to make room (at least 1)
        assert len(prepare_store_output.evicted_keys) >= 1

    def test_adaptive_target(self):
        """Tests ARC's adaptive target adjustment via ghost lists.
        When a chunk in B1 (ghost list) is accessed, target_t1_size increases.
        When a chunk in B2 is accessed, target_t1_size decreases.
        """
        cpu_manager, arc_policy = self._make_manager(num_chunks=2, enable_events=False)

        # store chunks 1, 2 (fills cache)
        cpu_manager.prepare_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
        cpu_manager.complete_store(to_keys([1, 2]), _EMPTY_REQ_CTX)

        initial_target = arc_policy.target_t1_size

        # store chunk 3, evicting chunk 1 (moves to B1 ghost list)
        cpu_manager.prepare_store(to_keys([3]), _EMPTY_REQ_CTX)
        cpu_manager.complete_store(to_keys([3]), _EMPTY_REQ_CTX)

        # chunk 1 should be in B1 (ghost list)
        assert to_keys([1])[0] in arc_policy.b1

        # store chunk 1 again (cache miss, but in B1)
        # this should increase target_t1_size (favor recency)
        cpu_manager.prepare_store(to_keys([1]), make_req_context("ghost-hit"))

        # target should have increased
        assert arc_policy.target_t1_size > initial_target

    def test_t1_t2_eviction_policy(self):
        """Tests that ARC evicts from T1 or T2 based on target_t1_size.
        If |T1| >= target_t1_size, evict from T1, otherwise from T2.
        """
        cpu_manager, arc_policy = self._make_manager(enable_events=False)

        # store chunks 1, 2, 3, 4
        cpu_manager.prepare_store(to_keys([1, 2, 3, 4]), _EMPTY_REQ_CTX)
        cpu_manager.complete_store(to_keys([1, 2, 3, 4]), _EMPTY_REQ_CTX)

        # promote chunks 3, 4 to T2 by reusing them
        reuse_keys(cpu_manager, to_keys([3, 4]))

        # now: T1 = {1, 2}, T2 = {3, 4}
        assert len(arc_policy.t1) == 2
        assert len(arc_policy.t2) == 2

        # set target_t1_size to prefer evicting from T1
        # (when |T1| >= target, evict from T1)
        arc_policy.target_t1_size = 1

        # store chunk 5, should evict from T1 (chunk 1, LRU in T1)
        output = cpu_manager.prepare_store(to_keys([5]), _EMPTY_REQ_CTX)
        assert output is not None
        assert to_keys([1]) == output.evicted_keys

        cpu_manager.complete_store(to_keys([5]), _EMPTY_REQ_CTX)

        # chunk 1 should be in B1 (ghost list)
        assert to_keys([1])[0] in arc_policy.b1
        # chunk 5 should be in T1
        assert to_keys([5])[0] in arc_policy.t1

    def test_batch_eviction_scans_t1_and_t2_once(self):
        """ARC batch eviction must preserve order without restarting scans."""
        cpu_manager, arc_policy = self._make_manager(
            num_chunks=256, enable_events=False
        )
        keys = to_keys(list(range(256)))
        cpu_manager.prepare_store(keys, _EMPTY_REQ_CTX)
        cpu_manager.complete_store(keys, _EMPTY_REQ_CTX)

        reuse_keys(cpu_manager, keys[128:])
        arc_policy.target_t1_size = 64

        protected = {keys[0], keys[2], keys[255]}
        arc_policy.t1[keys[1]].ref_cnt = 1
        arc_policy.t2[keys[254]].ref_cnt = 1

        num_evictions = 124
        num_t1_evictions = len(arc_policy.t1) - int(arc_policy.target_t1_size) + 1
        num_t2_evictions = num_evictions - num_t1_evictions
        t1_order = list(arc_policy.t1)
        t2_order = list(arc_policy.t2)
        expected_t1 = [
            key
            for key, chunk in arc_policy.t1.items()
            if chunk.ref_cnt == 0 and key not in protected
        ][:num_t1_evictions]
        expected_t2 = [
            key
            for key, chunk in arc_policy.t2.items()
            if chunk.ref_cnt == 0 and key not in protected
        ][:num_t2_evictions]
        expected_t1_scans = t1_order.index(expected_t1[-1]) + 1
        expected_t2_scans = t2_order.index(expected_t2[-1]) + 1

        counting_t1 = _CountingOrderedDict(arc_policy.t1)
        counting_t2 = _CountingOrderedDict(arc_policy.t2)
        arc_policy.t1 = counting_t1
        arc_policy.t2 = counting_t2

        evicted = arc_policy.evict(num_evictions, protected)

        assert evicted is not None
        assert [key for key, _ in evicted] == expected_t1 + expected_t2
        assert counting_t1.items_yielded == expected_t1_scans
        assert counting_t2.items_yielded == expected_t2_scans

    def test_batch_eviction_falls_back_after_t1_iterator_exhausted(self):
        """An exhausted T1 scan must keep falling back to T2."""
        cpu_manager, arc_policy = self._make_manager(num_chunks=8, enable_events=False)
        keys = to_keys(list(range(8)))
        cpu_manager.prepare_store(keys, _EMPTY_REQ_CTX)
        cpu_manager.complete_store(keys, _EMPTY_REQ_CTX)

        reuse_keys(cpu_manager, keys[6:])
        arc_policy.target_t1_size = 4

        t1_order = list(arc_policy.t1)
        t2_order = list(arc_policy.t2)
        protected = set(t1_order[1:3])
        for key in t1_order[3:]:
            arc_policy.t1[key].ref_cnt = 1

        # Selecting the sole eligible T1 entry leaves virtual_t1_size above
        # the target, so each remaining selection must retry T1 then use T2.
        eligible_t1 = [
            key
            for key, chunk in arc_policy.t1.items()
            if chunk.ref_cnt == 0 and key not in protected
        ]
        assert eligible_t1 == t1_order[:1]
        assert len(t1_order) - 1 >= int(arc_policy.target_t1_size)

        counting_t1 = _CountingOrderedDict(arc_policy.t1)
        counting_t2 = _CountingOrderedDict(arc_policy.t2)
        arc_policy.t1 = counting_t1
        arc_policy.t2 = counting_t2

        evicted = arc_policy.evict(3, protected)

        assert evicted is not None
        assert [key for key, _ in evicted] == [t1_order[0], *t2_order]
        assert counting_t1.items_yielded == len(t1_order)
        assert counting_t2.items_yielded == len(t2_order)

    @pytest.mark.parametrize(
        "pinned, protected, new_keys, expected_evicted",
        [
            ([], [], [7, 8, 9], [6, 5, 3]),
            ([], [], [7, 8, 9, 10], [6, 5, 3, 4]),
            ([5, 6], [], [7, 8], [3, 4]),
            ([], [5, 6], [7, 8], [3, 4]),
            ([5, 6], [3], [7], [4]),
            ([5, 6], [3], [7, 8], None),
        ],
    )
    def test_store_falls_back_to_t1_when_t2_cannot_satisfy_eviction(
        self, pinned, protected, new_keys, expected_evicted
    ):
        """A preference for T2 must not reject stores that can reclaim T1."""
        manager, policy = self._make_manager(enable_events=False)
        for keys in ([1, 2, 3, 4], [5, 6]):
            assert manager.prepare_store(to_keys(keys), _EMPTY_REQ_CTX) is not None
            manager.complete_store(to_keys(keys), _EMPTY_REQ_CTX)

        # Ghost hits raise the target to 3; promotion leaves only 2 entries in T1.
        policy.on_store_miss(to_keys([1, 2]), _EMPTY_REQ_CTX)
        policy.on_store_miss(to_keys([1]), _EMPTY_REQ_CTX)
        reuse_keys(manager, to_keys([5, 6]))
        assert policy.target_t1_size == 3
        assert list(policy.t1) == to_keys([3, 4])
        assert list(policy.t2) == to_keys([6, 5])
        manager.prepare_load(to_keys(pinned), _EMPTY_REQ_CTX)

        counting_t1 = _CountingOrderedDict(policy.t1)
        counting_t2 = _CountingOrderedDict(policy.t2)
        policy.t1 = counting_t1
        policy.t2 = counting_t2
        before = [list(q.items()) for q in (policy.t1, policy.t2, policy.b1, policy.b2)]
        counting_t1.items_yielded = counting_t2.items_yielded = 0
        output = manager.prepare_store(to_keys(protected + new_keys), _EMPTY_REQ_CTX)
        assert counting_t1.items_yielded <= len(before[0])
        assert counting_t2.items_yielded <= len(before[1])

        if expected_evicted is None:
            assert output is None
            assert [
                list(q.items()) for q in (policy.t1, policy.t2, policy.b1, policy.b2)
            ] == before
        else:
            assert output is not None
            assert output.keys_to_store == to_keys(new_keys)
            assert output.evicted_keys == to_keys(expected_evicted)
            manager.complete_store(to_keys(new_keys), _EMPTY_REQ_CTX)
            for key in new_keys:
                assert manager.lookup(to_key(key), _EMPTY_REQ_CTX) is LookupResult.HIT
        for key in pinned + protected:
            assert manager.lookup(to_key(key), _EMPTY_REQ_CTX) is LookupResult.HIT
        manager.complete_load(to_keys(pinned), _EMPTY_REQ_CTX)

    def test_batch_eviction_failure_is_atomic(self):
        """Finding only some candidates must not partially evict the cache."""
        cpu_manager, arc_policy = self._make_manager(num_chunks=4, enable_events=False)
        keys = to_keys(list(range(4)))
        cpu_manager.prepare_store(keys, _EMPTY_REQ_CTX)
        cpu_manager.complete_store(keys, _EMPTY_REQ_CTX)

        before_t1 = list(arc_policy.t1.items())
        protected = set(keys[1:])

        assert arc_policy.evict(2, protected) is None
        assert list(arc_policy.t1.items()) == before_t1
        assert not arc_policy.t2
        assert not arc_policy.b1
        assert not arc_policy.b2

    def test_ghost_list_bounds(self):
        """Tests that ghost lists (B1, B2) don't grow unbounded.
        They should be capped at cache_capacity.
        """
        cpu_manager, arc_policy = self._make_manager(num_chunks=2, enable_events=False)

        # fill cache with chunks 1, 2
        cpu_manager.prepare_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
        cpu_manager.complete_store(to_keys([1, 2]), _EMPTY_REQ_CTX)

        # store many chunks to fill ghost lists
        for i in range(3, 20):
            cpu_manager.prepare_store(to_keys([i]), _EMPTY_REQ_CTX)
            cpu_manager.complete_store(to_keys([i]), _EMPTY_REQ_CTX)

        # ghost lists should not exceed cache_capacity
        assert len(arc_policy.b1) <= arc_policy.cache_capacity
        assert len(arc_policy.b2) <= arc_policy.cache_capacity

    def test_reuse_ordering(self):
        """Tests that request reuse correctly updates access patterns.
        Similar to LRU test but verifies T1/T2 ordering.
        """
        cpu_manager, arc_policy = self._make_manager()

        # store chunks 1, 2, 3, 4
        cpu_manager.prepare_store(to_keys([1, 2, 3, 4]), _EMPTY_REQ_CTX)
        cpu_manager.complete_store(to_keys([1, 2, 3, 4]), _EMPTY_REQ_CTX)

        # promote 3, 4 to T2
        reuse_keys(cpu_manager, to_keys([3, 4]))

        # T1 = {1, 2}, T2 = {3, 4}
        # reuse [1, 3, 4] - should promote 1 to T2, and move 3,4 to end of T2
        reuse_keys(cpu_manager, to_keys([1, 3, 4]))

        # T1 = {2}, T2 = {1, 3, 4} (in that order, with 4 most recent)
        assert len(arc_policy.t1) == 1
        assert len(arc_policy.t2) == 3

        # store chunk 5, should evict from T1 (chunk 2, only one in T1)
        prepare_store_output = cpu_manager.prepare_store(to_keys([5]), _EMPTY_REQ_CTX)
        verify_store_output(
            prepare_store_output,
            ExpectedPrepareStoreOutput(
                keys_to_store=[5],
                store_chunk_ids=[1],  # reuses chunk 2's storage
                evicted_keys=[2],
            ),
        )

    def test_failed_store(self):
        """Tests that failed store operations clean up correctly.
        Similar to LRU test but for ARC.
        """
        cpu_manager, arc_policy = self._make_manager()

        # store chunks 1, 2, 3, 4
        cpu_manager.prepare_store(to_keys([1, 2, 3, 4]), _EMPTY_REQ_CTX)
        cpu_manager.complete_store(to_keys([1, 2, 3, 4]), _EMPTY_REQ_CTX)

        # prepare store chunk 5 (will evict chunk 1)
        prepare_store_output = cpu_manager.prepare_store(to_keys([5]), _EMPTY_REQ_CTX)
        assert prepare_store_output is not None
        assert len(prepare_store_output.evicted_keys) == 1

        # complete store with failure
        cpu_manager.complete_store(to_keys([5]), _EMPTY_REQ_CTX, success=False)

        # chunk 5 should not be in cache
        assert cpu_manager.lookup(to_key(5), _EMPTY_REQ_CTX) is LookupResult.MISS
        # chunk 5 should not be in T1 or T2
        assert to_keys([5])[0] not in arc_policy.t1
        assert to_keys([5])[0] not in arc_policy.t2

        # evicted chunk should still be gone (in B1 ghost list)
        evicted_hash = prepare_store_output.evicted_keys[0]
        assert evicted_hash in arc_policy.b1

    def test_full_scenario(self):
        """Comprehensive test covering multiple ARC operations in sequence.
        Similar to the full LRU test but adapted for ARC behavior.
        """
        cpu_manager, arc_policy = self._make_manager()

        # store [1, 2]
        cpu_manager.prepare_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
        cpu_manager.complete_store(to_keys([1, 2]), _EMPTY_REQ_CTX)

        # store [3, 4, 5] -> evicts [1]
        prepare_store_output = cpu_manager.prepare_store(
            to_keys([3, 4, 5]), _EMPTY_REQ_CTX
        )
        assert prepare_store_output is not None
        assert len(prepare_store_output.evicted_keys) == 1
        cpu_manager.complete_store(to_keys([3, 4, 5]), _EMPTY_REQ_CTX)

        # promote some chunks to T2
        reuse_keys(cpu_manager, to_keys([2, 3]))

        # T1 has {4, 5}, T2 has {2, 3}
        assert len(arc_policy.t1) == 2
        assert len(arc_policy.t2) == 2

        # store [6] -> should evict from T1 (4 is oldest in T1)
        prepare_store_output = cpu_manager.prepare_store(to_keys([6]), _EMPTY_REQ_CTX)
        assert prepare_store_output is not None
        cpu_manager.complete_store(to_keys([6]), _EMPTY_REQ_CTX)

        # verify chunks 2, 3 (in T2) are still present
        assert cpu_manager.lookup(to_key(2), _EMPTY_REQ_CTX) is LookupResult.HIT
        assert cpu_manager.lookup(to_key(3), _EMPTY_REQ_CTX) is LookupResult.HIT

        # verify events
        events = list(cpu_manager.take_events())
        assert len(events) > 0  # should have store and eviction events


def test_take_events_prunes_retried_cleanup_and_drains_once():
    """Failed-write cleanup must not outlive a retry that re-owns the key, and a
    partially consumed drain must not replay it."""
    manager = make_cpu_manager(num_chunks=4, cache_policy="lru", enable_events=True)

    assert manager.prepare_store(to_keys([1, 2]), _EMPTY_REQ_CTX) is not None
    manager.complete_store(to_keys([1, 2]), _EMPTY_REQ_CTX, success=False)
    # A retry re-allocates key 1 before the cleanup is drained.
    assert manager.prepare_store(to_keys([1]), _EMPTY_REQ_CTX) is not None
    assert manager.prepare_store(to_keys([3]), _EMPTY_REQ_CTX) is not None
    manager.complete_store(to_keys([3]), _EMPTY_REQ_CTX)

    drain = iter(manager.take_events())
    cleanup = next(drain)
    assert cleanup.removed and cleanup.metadata_only
    assert cleanup.keys == to_keys([2])
    # Stopping early must not leave the batch queued for the next drain.
    assert list(manager.take_events()) == []
    assert [event.keys for event in drain] == [to_keys([3])]


def test_filter_reused_manager():
    """Tests CPUOffloadingManager reuse filtering (store_threshold=2)."""
    manager = make_cpu_manager(
        num_chunks=4,
        cache_policy="lru",
        enable_events=True,
        store_threshold=2,
        max_tracker_size=3,
    )

    # lookup() does not count towards store admission
    assert manager.lookup(to_key(1), _EMPTY_REQ_CTX) is LookupResult.MISS
    assert manager.lookup(to_key(2), _EMPTY_REQ_CTX) is LookupResult.MISS
    # store_threshold > 1 means the reuse tracker is enabled, so counts exists.
    assert manager.counts is not None
    assert not manager.counts

    # 1st offer of [1, 2] -> tracked at count 1, not eligible yet
    prepare_store_output = manager.prepare_store(to_keys([1, 2]), _EMPTY_REQ_CTX)
    assert prepare_store_output is not None
    assert prepare_store_output.keys_to_store == []
    assert manager.counts[to_keys([1])[0]] == 1
    assert manager.counts[to_keys([2])[0]] == 1

    # 2nd offer, by another request -> the whole repeated prefix becomes
    # eligible at once
    prepare_store_output = manager.prepare_store(
        to_keys([1, 2]), make_req_context("second")
    )
    assert prepare_store_output is not None
    assert prepare_store_output.keys_to_store == to_keys([1, 2])
    manager.complete_store(to_keys([1, 2]), _EMPTY_REQ_CTX)

    # Offer [3, 4] -> 1st time, evicting the tracker's LRU entry [1]
    prepare_store_output = manager.prepare_store(to_keys([3, 4]), _EMPTY_REQ_CTX)
    assert prepare_store_output is not None
    assert prepare_store_output.keys_to_store == []
    assert to_keys([1])[0] not in manager.counts
    assert manager.counts[to_keys([3])[0]] == 1
    assert manager.counts[to_keys([4])[0]] == 1

    # [1] re-enters the tracker at count 1, so it is filtered again
    prepare_store_output = manager.prepare_store(to_keys([1]), _EMPTY_REQ_CTX)
    assert prepare_store_output is not None
    assert prepare_store_output.keys_to_store == []
    assert manager.counts.get(to_keys([1])[0]) == 1


def test_filter_reused_manager_oversized_offer_makes_progress():
    """An offer larger than the tracker capacity must not churn forever."""
    manager = make_cpu_manager(
        num_chunks=4,
        cache_policy="lru",
        store_threshold=2,
        max_tracker_size=3,
    )
    keys = to_keys([1, 2, 3, 4])
    stored_keys: set[OffloadKey] = set()

    for i in range(4):
        remaining_keys = [key for key in keys if key not in stored_keys]
        output = manager.prepare_store(remaining_keys, make_req_context(f"req-{i}"))
        assert output is not None
        if output.keys_to_store:
            manager.complete_store(output.keys_to_store, _EMPTY_REQ_CTX)
            stored_keys.update(output.keys_to_store)

    assert stored_keys == set(keys)


def test_store_threshold_does_not_hide_ready_reuse():
    manager = make_cpu_manager(
        num_chunks=2,
        cache_policy="lru",
        store_threshold=2,
        max_tracker_size=2,
    )
    head, tail, noise_1, noise_2, replacement = to_keys(list(range(5)))

    output = manager.prepare_store([head, tail], make_req_context("seed-first"))
    assert output is not None
    assert not output.keys_to_store
    seed_ctx = make_req_context("seed")
    output = manager.prepare_store([head, tail], seed_ctx)
    assert output is not None
    assert output.keys_to_store == [head, tail]
    manager.complete_store([head, tail], seed_ctx)
    manager.on_request_finished(seed_ctx)

    # Age both resident keys out of the admission tracker without storing the
    # noise keys. Reusing the tail recreates its counter at one, below the
    # threshold, but must still refresh its cache recency.
    output = manager.prepare_store([noise_1, noise_2], make_req_context("noise"))
    assert output is not None
    assert not output.keys_to_store
    reuse_ctx = make_req_context("reuse")
    skipped_before_reuse = manager.stores_skipped_in_current_batch
    output = manager.prepare_store([tail], reuse_ctx)
    assert output is not None
    assert not output.keys_to_store
    assert manager.stores_skipped_in_current_batch == skipped_before_reuse
    manager.on_request_finished(reuse_ctx)

    output = manager.prepare_store([replacement], make_req_context("replacement-first"))
    assert output is not None
    assert not output.keys_to_store
    replacement_ctx = make_req_context("replacement")
    output = manager.prepare_store([replacement], replacement_ctx)
    assert output is not None
    assert output.evicted_keys == [head]


@pytest.mark.parametrize("store_threshold", [2, 3])
def test_store_threshold_does_not_count_retries_of_a_failed_offer(
    store_threshold: int,
):
    """After prepare_store() returns None, the scheduler offers the same keys
    again. A retry must not admit a key that only one request offered, nor
    count that key's skip again."""
    manager = make_cpu_manager(num_chunks=2, store_threshold=store_threshold)
    pinned = to_keys([100, 101])
    warm, cold = to_keys([1, 2])

    # Other requests offer `pinned` and `warm`, so one more offer admits them.
    for i in range(store_threshold - 1):
        manager.prepare_store([*pinned, warm], make_req_context(f"warmup-{i}"))
    # Fill both chunks with stores that stay in flight.
    pin_ctx = make_req_context("pin")
    output = manager.prepare_store(pinned, pin_ctx)
    assert output is not None
    assert output.keys_to_store == pinned
    manager.get_stats()  # drop the warm-up skips

    ctx = make_req_context("req")
    assert manager.prepare_store([warm, cold], ctx) is None
    assert manager.prepare_store([warm, cold], ctx) is None
    # The stores complete, so both chunks become evictable.
    manager.complete_store(pinned, pin_ctx)
    output = manager.prepare_store([warm, cold], ctx)
    assert output is not None
    assert output.keys_to_store == [warm]
    assert manager.counts is not None
    assert manager.counts[cold] == 1
    stats = manager.get_stats()
    assert stats is not None
    assert stats.reduce()[CPUOffloadingMetrics.STORES_SKIPPED] == 1


@pytest.mark.parametrize("store_threshold", [2, 3])
def test_store_threshold_counts_a_key_once_per_request(store_threshold: int):
    """A preempted request restarts its stores from chunk 0 and offers its keys
    again through the same context. Each key counts once per request, so the
    re-offers must not admit a key that only this request offered, nor count
    its skip again. Another request's offer still counts."""
    manager = make_cpu_manager(num_chunks=4, store_threshold=store_threshold)
    warm, cold = to_keys([1, 2])

    # Other requests offer `warm`, so one more offer admits it.
    for i in range(store_threshold - 1):
        manager.prepare_store([warm], make_req_context(f"warmup-{i}"))
    manager.get_stats()  # drop the warm-up skips

    ctx = make_req_context("req")
    output = manager.prepare_store([warm, cold], ctx)
    assert output is not None
    assert output.keys_to_store == [warm]
    manager.complete_store([warm], ctx)

    # Preempted and rescheduled, as often as it takes to reach the threshold.
    for _ in range(store_threshold - 1):
        output = manager.prepare_store([warm, cold], ctx)
        assert output is not None
        assert output.keys_to_store == []
    assert manager.counts is not None
    assert manager.counts[cold] == 1
    stats = manager.get_stats()
    assert stats is not None
    assert stats.reduce()[CPUOffloadingMetrics.STORES_SKIPPED] == 1

    manager.prepare_store([cold], make_req_context("other"))
    assert manager.counts[cold] == 2


def test_evictable_cache_chunk_count(monkeypatch):
    """Verifies _num_evictable_cache_chunks is maintained correctly through the
    full store/load lifecycle, eviction, failed stores, concurrent loads,
    reset_cache, and the early-exit fast path in prepare_store.
    """
    manager = make_cpu_manager(num_chunks=4, cache_policy="lru")

    # Initially no chunks allocated.
    assert manager._num_evictable_cache_chunks == 0

    # Initial cache state [x, x, x, x]

    # We get 3 chunks from the cache.
    manager.prepare_store(to_keys([1, 2, 3]), _EMPTY_REQ_CTX)
    # cache state [1', 2', 3', x] <- 1', 2', 3' are actively being used.
    assert manager._num_evictable_cache_chunks == 0

    # Completing stores makes them idle.
    manager.complete_store(to_keys([1, 2, 3]), _EMPTY_REQ_CTX)
    # cache state [1, 2, 3, x] <- 1, 2, 3 chunks are idle.
    assert manager._num_evictable_cache_chunks == 3

    # prepare_load pins a chunk: idle count decrements once even if the
    # same chunk is loaded by two concurrent callers.
    manager.prepare_load(to_keys([1]), _EMPTY_REQ_CTX)
    # cache state [1', 2, 3, x] <- 2, 3 chunks are idle.
    assert manager._num_evictable_cache_chunks == 2
    manager.prepare_load(to_keys([1]), _EMPTY_REQ_CTX)  # 2nd concurrent load
    # cache state [1', 2, 3, x] <- 2, 3 chunks are idle.
    assert manager._num_evictable_cache_chunks == 2  # no double-decrement

    # First complete_load does not restore idle (ref_cnt still 1).
    manager.complete_load(to_keys([1]), _EMPTY_REQ_CTX)
    # cache state [1', 2, 3, x] <- 2, 3 chunks are idle.
    assert manager._num_evictable_cache_chunks == 2
    # Second complete_load drops ref_cnt to 0 -> chunk becomes idle again.
    manager.complete_load(to_keys([1]), _EMPTY_REQ_CTX)
    # cache state [1, 2, 3, x] <- 1, 2, 3 chunks are idle.
    assert manager._num_evictable_cache_chunks == 3

    # Eviction decrements idle count.
    # Cache has 3 stored chunks and 1 free slot. Storing 3 new keys needs 2 eviction.
    manager.prepare_store(to_keys([4, 5, 6]), _EMPTY_REQ_CTX)
    # cache state [1, 4', 5', 6'] <- chunk 1 is idle
    assert manager._num_evictable_cache_chunks == 1

    # Failed store does not increment idle count (chunk discarded from cache).
    manager.complete_store(to_keys([4, 5, 6]), _EMPTY_REQ_CTX, success=False)
    # cache state [1, x, x, x] <- chunk 1 is idle. Other returned to cache.
    assert manager._num_evictable_cache_chunks == 1

    # reset_cache zeroes the count unconditionally.
    manager.reset_cache()
    # cache state [x, x, x, x]
    assert manager._num_evictable_cache_chunks == 0

    # setup 3 chunks with loads so idle count drops to 0.
    manager.prepare_store(to_keys([10, 11, 12]), _EMPTY_REQ_CTX)
    manager.complete_store(to_keys([10, 11, 12]), _EMPTY_REQ_CTX)
    manager.prepare_load(to_keys([10, 11, 12]), _EMPTY_REQ_CTX)
    # cache state [10', 11', 12', x]
    assert manager._num_evictable_cache_chunks == 0

    # prepare_store requiring eviction must return None immediately (fast exit).
    # Spy on policy.evict to confirm the fast path short-circuits before calling it.
    evict_called = False
    original_evict = manager._policy.evict

    def spy_evict(*args, **kwargs):
        nonlocal evict_called
        evict_called = True
        return original_evict(*args, **kwargs)

    monkeypatch.setattr(manager._policy, "evict", spy_evict)
    # cache state [10', 11', 12', x] <- cannot evict anything
    assert manager.prepare_store(to_keys([14, 15]), _EMPTY_REQ_CTX) is None
    assert not evict_called, (
        "_num_evictable_cache_chunks==0 should short-circuit before evict()"
    )

    # After releasing the loads, eviction becomes possible again.
    manager.complete_load(to_keys([10, 11, 12]), _EMPTY_REQ_CTX)
    # cache state [10, 11, 12, x] <- 10, 11, 12 are idle
    assert manager._num_evictable_cache_chunks == 3
    assert manager.prepare_store(to_keys([14, 15]), _EMPTY_REQ_CTX) is not None
    # cache state [10, 11, 14', 15'] <- 10, 11 are idle
    assert manager._num_evictable_cache_chunks == 2
    manager.complete_store(to_keys([14, 15]), _EMPTY_REQ_CTX)
    # cache state [10, 11, 14, 15] <- all chunks idle
    assert manager._num_evictable_cache_chunks == 4


@pytest.mark.parametrize("finish_before_completion", [False, True])
def test_request_finish_orders_lru_prefix_independent_of_store_completion(
    finish_before_completion: bool,
):
    """A transfer's completion order must not make the prefix head LRU."""
    manager = make_cpu_manager(num_chunks=4, cache_policy="lru")
    prefix = to_keys([1, 2, 3, 4])
    ctx = make_req_context("prefix")

    output = manager.prepare_store(prefix, ctx)
    assert output is not None
    if finish_before_completion:
        manager.on_request_finished(ctx)
    manager.complete_store(set(prefix), ctx)
    if not finish_before_completion:
        manager.on_request_finished(ctx)

    output = manager.prepare_store(to_keys([5]), make_req_context("evict"))
    assert output is not None
    assert output.evicted_keys == to_keys([4])


@pytest.mark.parametrize("finish_before_completion", [False, True])
def test_request_finish_orders_lru_prefix_independent_of_load_completion(
    finish_before_completion: bool,
):
    manager = make_cpu_manager(num_chunks=4, cache_policy="lru")
    prefix = to_keys([1, 2, 3, 4])

    seed_ctx = make_req_context("seed")
    output = manager.prepare_store(prefix, seed_ctx)
    assert output is not None
    manager.complete_store(prefix, seed_ctx)

    reuse_ctx = make_req_context("reuse")
    manager.prepare_load(prefix, reuse_ctx)
    if finish_before_completion:
        manager.on_request_finished(reuse_ctx)
    manager.complete_load(set(prefix), reuse_ctx)
    if not finish_before_completion:
        manager.on_request_finished(reuse_ctx)

    output = manager.prepare_store(to_keys([5]), make_req_context("evict"))
    assert output is not None
    assert output.evicted_keys == to_keys([4])


def test_late_old_completion_does_not_override_newer_request_recency():
    manager = make_cpu_manager(num_chunks=4, cache_policy="lru")
    old_keys = to_keys([1, 2])
    new_keys = to_keys([3, 4])

    old_ctx = make_req_context("old")
    assert manager.prepare_store(old_keys, old_ctx) is not None
    manager.on_request_finished(old_ctx)

    new_ctx = make_req_context("new")
    assert manager.prepare_store(new_keys, new_ctx) is not None
    manager.complete_store(new_keys, new_ctx)
    manager.on_request_finished(new_ctx)

    # Physical completion is late, but the logical access is still older.
    manager.complete_store(old_keys, old_ctx)

    output = manager.prepare_store(to_keys([5]), make_req_context("evict"))
    assert output is not None
    assert output.evicted_keys == [old_keys[-1]]


def test_arc_counts_reuse_once_and_keeps_insertions_in_t1():
    manager = make_cpu_manager(num_chunks=4, cache_policy="arc")
    policy = manager._policy
    assert isinstance(policy, ARCCachePolicy)
    prefix = to_keys([1, 2, 3, 4])

    seed_ctx = make_req_context("seed")
    assert manager.prepare_store(prefix, seed_ctx) is not None
    manager.complete_store(prefix, seed_ctx)
    # Repeated store offers from the same request must not become ARC hits.
    assert manager.prepare_store(prefix, seed_ctx) is not None
    # Nor should an internal read used to cascade the new chunks to a tier.
    manager.prepare_load(prefix, seed_ctx)
    manager.complete_load(prefix, seed_ctx)
    manager.on_request_finished(seed_ctx)

    assert list(policy.t1) == list(reversed(prefix))
    assert not policy.t2

    reuse_ctx = make_req_context("reuse")
    manager.prepare_load(prefix, reuse_ctx)
    manager.complete_load(prefix, reuse_ctx)
    # A duplicate internal pin, as used by tiering cascades, is deduplicated.
    manager.prepare_load(prefix, reuse_ctx)
    manager.complete_load(prefix, reuse_ctx)
    manager.on_request_finished(reuse_ctx)

    assert not policy.t1
    assert list(policy.t2) == list(reversed(prefix))


def test_arc_reuse_wins_if_same_request_later_reinserts_key():
    manager = make_cpu_manager(num_chunks=1, cache_policy="arc")
    policy = manager._policy
    assert isinstance(policy, ARCCachePolicy)
    key_1, key_2 = to_keys([1, 2])

    seed_ctx = make_req_context("seed")
    assert manager.prepare_store([key_1], seed_ctx) is not None
    manager.complete_store([key_1], seed_ctx)
    manager.on_request_finished(seed_ctx)

    reuse_ctx = make_req_context("reuse-and-reinsert")
    manager.prepare_load([key_1], reuse_ctx)
    manager.complete_load([key_1], reuse_ctx)

    other_ctx = make_req_context("evict-reused-key")
    assert manager.prepare_store([key_2], other_ctx) is not None
    manager.complete_store([key_2], other_ctx)
    manager.on_request_finished(other_ctx)

    assert manager.prepare_store([key_1], reuse_ctx) is not None
    manager.complete_store([key_1], reuse_ctx)
    manager.on_request_finished(reuse_ctx)

    assert key_1 not in policy.t1
    assert list(policy.t2) == [key_1]


def test_request_finish_forwards_grouped_deduplicated_accesses(monkeypatch):
    manager = make_cpu_manager(num_chunks=5)
    existing = make_offload_key(b"existing", 0)
    group_0_new = make_offload_key(b"group-0-new", 0)
    group_1_head = make_offload_key(b"group-1-head", 1)
    group_1_tail = make_offload_key(b"group-1-tail", 1)

    seed_ctx = make_req_context("seed")
    assert manager.prepare_store([existing], seed_ctx) is not None
    manager.complete_store([existing], seed_ctx)

    ctx = make_req_context("grouped")
    # Group 1 is observed first, but policy finalization follows group index.
    offered = [group_1_head, existing, group_0_new]
    assert manager.prepare_store(offered, ctx) is not None
    # Later offers extend a group's prefix and may repeat earlier keys.
    assert (
        manager.prepare_store([group_0_new, group_1_head, group_1_tail], ctx)
        is not None
    )

    received = []

    def on_request_finished(key_groups, insertion_only_keys, reused_keys, req_context):
        received.append((key_groups, insertion_only_keys, reused_keys, req_context))

    monkeypatch.setattr(manager._policy, "on_request_finished", on_request_finished)
    manager.on_request_finished(ctx)
    manager.on_request_finished(ctx)

    assert received == [
        (
            ((existing, group_0_new), (group_1_head, group_1_tail)),
            {group_0_new, group_1_head, group_1_tail},
            {existing},
            ctx,
        )
    ]


def test_failed_store_records_access_once_and_uses_store_miss_hook(monkeypatch):
    manager = make_cpu_manager(num_chunks=1)
    resident, candidate = to_keys([1, 2])

    seed_ctx = make_req_context("seed")
    assert manager.prepare_store([resident], seed_ctx) is not None
    manager.complete_store([resident], seed_ctx)

    pin_ctx = make_req_context("pin")
    manager.prepare_load([resident], pin_ctx)

    record_calls = 0
    original_record = manager._record_request_cache_access

    def record_access(*args, **kwargs):
        nonlocal record_calls
        record_calls += 1
        return original_record(*args, **kwargs)

    store_miss_calls = []

    def on_store_miss(keys, req_context):
        store_miss_calls.append((list(keys), req_context))

    finalized = []

    def on_request_finished(key_groups, insertion_only_keys, reused_keys, req_context):
        finalized.append((key_groups, insertion_only_keys, reused_keys, req_context))

    monkeypatch.setattr(manager, "_record_request_cache_access", record_access)
    monkeypatch.setattr(manager._policy, "on_store_miss", on_store_miss)
    monkeypatch.setattr(manager._policy, "on_request_finished", on_request_finished)

    ctx = make_req_context("failed-store")
    assert manager.prepare_store([candidate, resident], ctx) is None
    assert record_calls == 1
    assert store_miss_calls == [([candidate], ctx)]

    manager.on_request_finished(ctx)
    assert finalized == [
        (((candidate, resident),), set(), {resident}, ctx),
    ]

    manager.complete_load([resident], pin_ctx)


def test_arc_ghost_hit_adapts_once_per_request_before_insertion():
    manager = make_cpu_manager(num_chunks=2, cache_policy="arc")
    policy = manager._policy
    assert isinstance(policy, ARCCachePolicy)
    keys = to_keys([1, 2, 3])

    seed_ctx = make_req_context("seed")
    assert manager.prepare_store(keys[:2], seed_ctx) is not None
    manager.complete_store(keys[:2], seed_ctx)
    manager.on_request_finished(seed_ctx)

    evict_ctx = make_req_context("create-ghost")
    output = manager.prepare_store([keys[2]], evict_ctx)
    assert output is not None
    [ghost_key] = output.evicted_keys
    manager.complete_store([keys[2]], evict_ctx)
    manager.on_request_finished(evict_ctx)
    assert ghost_key in policy.b1

    resident_keys = [key for key in keys if key != ghost_key]
    pin_ctx = make_req_context("pin-residents")
    manager.prepare_load(resident_keys, pin_ctx)

    ghost_ctx = make_req_context("ghost-hit")
    target_before = policy.target_t1_size
    assert manager.prepare_store([ghost_key], ghost_ctx) is None
    target_after_first_offer = policy.target_t1_size
    assert target_after_first_offer > target_before
    assert manager.prepare_store([ghost_key], ghost_ctx) is None
    assert policy.target_t1_size == target_after_first_offer

    manager.complete_load(resident_keys, pin_ctx)
    output = manager.prepare_store([ghost_key], ghost_ctx)
    assert output is not None
    assert policy.target_t1_size == target_after_first_offer
    manager.complete_store([ghost_key], ghost_ctx)
    manager.on_request_finished(ghost_ctx)
    assert ghost_key in policy.t1
    assert ghost_key not in policy.t2


def test_arc_pending_chunk_is_not_a_frequency_hit():
    manager = make_cpu_manager(num_chunks=2, cache_policy="arc")
    policy = manager._policy
    assert isinstance(policy, ARCCachePolicy)
    key = to_key(1)

    writer_ctx = make_req_context("writer")
    assert manager.prepare_store([key], writer_ctx) is not None

    observer_ctx = make_req_context("pending-observer")
    output = manager.prepare_store([key], observer_ctx)
    assert output is not None and not output.keys_to_store
    manager.on_request_finished(observer_ctx)

    chunk = policy.get(key)
    assert chunk is not None and not chunk.is_ready
    assert key in policy.t1
    assert key not in policy.t2


def test_request_key_positions_override_store_observation_order():
    manager = make_cpu_manager(num_chunks=2, cache_policy="lru")
    head, tail = to_keys([1, 2])
    ctx = make_req_context("out-of-order-store")
    ctx.set_offload_key_position(head, 16)
    ctx.set_offload_key_position(tail, 32)

    # A backfill or partial-tail path may offer a later key first.
    assert manager.prepare_store([tail], ctx) is not None
    assert manager.prepare_store([head], ctx) is not None
    manager.on_request_finished(ctx)
    manager.complete_store({head, tail}, ctx)

    output = manager.prepare_store([to_key(3)], make_req_context("evict-tail"))
    assert output is not None
    assert output.evicted_keys == [tail]


def test_request_key_positions_order_tails_across_kv_groups():
    manager = make_cpu_manager(num_chunks=4, cache_policy="lru")
    group_0_head = make_offload_key(b"group-0-head", 0)
    group_0_tail = make_offload_key(b"group-0-tail", 0)
    group_1_head = make_offload_key(b"group-1-head", 1)
    group_1_tail = make_offload_key(b"group-1-tail", 1)
    keys = [group_0_head, group_0_tail, group_1_head, group_1_tail]
    ctx = make_req_context("hybrid-groups")
    for key in (group_0_head, group_1_head):
        ctx.set_offload_key_position(key, 16)
    for key in (group_0_tail, group_1_tail):
        ctx.set_offload_key_position(key, 32)

    assert manager.prepare_store(keys, ctx) is not None
    manager.complete_store(keys, ctx)
    manager.on_request_finished(ctx)

    output = manager.prepare_store(to_keys([10, 11]), make_req_context("evict"))
    assert output is not None
    assert set(output.evicted_keys) == {group_0_tail, group_1_tail}


@pytest.mark.parametrize("batch_size", [1, 2, 3])
@pytest.mark.parametrize("reverse_completion", [False, True])
def test_unfinished_lru_prefix_survives_pressure_across_store_batches(
    batch_size, reverse_completion
):
    """Keep a contiguous prefix while its owner is still generating."""
    manager = make_cpu_manager(num_chunks=8)
    ctx = make_req_context("unfinished")
    groups = [
        [make_offload_key(str(position).encode(), group) for position in range(3)]
        for group in range(2)
    ]
    batches = []
    for start in range(0, 3, batch_size):
        batch = [key for group in groups for key in group[start : start + batch_size]]
        for group in groups:
            for position in range(start, min(start + batch_size, 3)):
                ctx.set_offload_key_position(group[position], (position + 1) * 16)
        assert manager.prepare_store(batch, ctx) is not None
        batches.append(batch)
        if not reverse_completion:
            manager.complete_store(batch, ctx)
    if reverse_completion:
        for batch in reversed(batches):
            manager.complete_store(batch, ctx)

    output = manager.prepare_store(to_keys([10, 11, 12, 13]), make_req_context("B"))
    assert output is not None
    assert set(output.evicted_keys) == {group[-1] for group in groups}
    for group in groups:
        assert all(manager.lookup(key, ctx) is LookupResult.HIT for key in group[:-1])


@pytest.mark.parametrize("reuse_method", ["load", "store"])
def test_unfinished_lru_reused_prefix_outlives_new_tail(reuse_method):
    manager = make_cpu_manager(num_chunks=4)
    head, middle, tail = to_keys([1, 2, 3])
    seed = make_req_context("seed")
    assert manager.prepare_store([head, middle], seed) is not None
    manager.complete_store([head, middle], seed)
    manager.on_request_finished(seed)

    ctx = make_req_context("reuse")
    for position, key in enumerate([head, middle, tail], 1):
        ctx.set_offload_key_position(key, position * 16)
    if reuse_method == "load":
        manager.prepare_load([head, middle], ctx)
        manager.complete_load([middle, head], ctx)
    else:
        assert manager.prepare_store([head, middle], ctx) is not None
    assert manager.prepare_store([tail], ctx) is not None
    manager.complete_store([tail], ctx)

    output = manager.prepare_store(to_keys([10, 11, 12]), make_req_context("B"))
    assert output is not None
    assert set(output.evicted_keys) == {middle, tail}
    assert manager.lookup(head, ctx) is LookupResult.HIT


def test_unfinished_lru_backfill_orders_by_token_position():
    manager = make_cpu_manager(num_chunks=3)
    ctx = make_req_context("backfill")
    head, middle, tail = to_keys([1, 2, 3])
    for position, key in enumerate([head, middle, tail], 1):
        ctx.set_offload_key_position(key, position * 16)
    for key in [head, tail, middle]:
        assert manager.prepare_store([key], ctx) is not None
        manager.complete_store([key], ctx)

    output = manager.prepare_store([to_key(4)], make_req_context("B"))
    assert output is not None
    assert output.evicted_keys == [tail]


def test_lru_failed_store_retry_preserves_prefix_order():
    manager = make_cpu_manager(num_chunks=2)
    ctx = make_req_context("retry")
    head, tail = to_keys([1, 2])
    ctx.set_offload_key_position(head, 16)
    ctx.set_offload_key_position(tail, 32)
    assert manager.prepare_store([head], ctx) is not None
    manager.complete_store([head], ctx, success=False)
    for key in [head, tail]:
        assert manager.prepare_store([key], ctx) is not None
        manager.complete_store([key], ctx)

    output = manager.prepare_store([to_key(3)], make_req_context("B"))
    assert output is not None
    assert output.evicted_keys == [tail]


def test_lru_reset_discards_unfinished_request_recency():
    manager = make_cpu_manager(num_chunks=2)
    ctx = make_req_context("resumed")
    head = to_key(1)
    ctx.set_offload_key_position(head, 16)
    assert manager.prepare_store([head], ctx) is not None
    manager.complete_store([head], ctx)
    manager.reset_cache()

    other = make_req_context("other")
    other_key = to_key(9)
    other.set_offload_key_position(other_key, 16)
    assert manager.prepare_store([other_key], other) is not None
    manager.complete_store([other_key], other)
    assert manager.prepare_store([head], ctx) is not None
    manager.complete_store([head], ctx)

    output = manager.prepare_store([to_key(10)], make_req_context("B"))
    assert output is not None
    assert output.evicted_keys == [other_key]


def test_older_lru_request_does_not_demote_a_newer_shared_access():
    manager = make_cpu_manager(num_chunks=3)
    old = make_req_context("old")
    pinned, cold, shared = to_keys([1, 2, 3])
    for context, key, position in [
        (old, pinned, 16),
        (make_req_context("cold"), cold, 16),
        (make_req_context("newer"), shared, 32),
    ]:
        context.set_offload_key_position(key, position)
        assert manager.prepare_store([key], context) is not None
        manager.complete_store([key], context)
    manager.prepare_load([pinned], old)

    old.set_offload_key_position(shared, 32)
    manager.prepare_load([shared], old)
    manager.complete_load([shared], old)
    output = manager.prepare_store([to_key(4)], make_req_context("pressure"))
    assert output is not None
    assert output.evicted_keys == [cold]
    manager.complete_load([pinned], old)


def test_lru_incremental_stores_do_not_rescan_the_prefix():
    class CountingContext(ReqContext):
        position_lookups = 0

        def get_offload_key_position(self, key: OffloadKey) -> int | None:
            self.position_lookups += 1
            return super().get_offload_key_position(key)

    keys = to_keys(list(range(64)))
    manager = make_cpu_manager(num_chunks=len(keys))
    ctx = CountingContext(req_id="incremental")
    for position, key in enumerate(keys, 1):
        ctx.set_offload_key_position(key, position * 16)
        assert manager.prepare_store([key], ctx) is not None
        manager.complete_store([key], ctx)

    assert 0 < ctx.position_lookups <= 3 * len(keys)


@pytest.mark.parametrize("ready_on_insert", [False, True])
def test_lru_insert_orders_positioned_chunks_without_followup_access(ready_on_insert):
    """Insertion alone orders new chunks, including out-of-order backfills."""
    policy = LRUCachePolicy(cache_capacity=3)
    ctx = make_req_context("insert")
    head, middle, tail = to_keys([1, 2, 3])
    for position, key in enumerate([head, middle, tail], 1):
        ctx.set_offload_key_position(key, position * 16)
    for chunk_id, key in enumerate([head, tail, middle]):
        chunk = ChunkStatus(chunk_id)
        if ready_on_insert:
            chunk.ref_cnt = 0
        policy.insert(key, chunk, ctx)
        if not ready_on_insert:
            chunk.ref_cnt = 0
            policy.mark_evictable(key)

    evicted = policy.evict(2, set())
    assert evicted is not None
    assert [key for key, _ in evicted] == [tail, middle]
    assert policy.get(head) is not None
