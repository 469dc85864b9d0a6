"""A small workload on vLLM 0.33.0's real offload managers (CPU only), for ``kvobs demo``.

Requests share prefixes and store more chunks than the CPU tier holds (eviction
pressure); two defects then happen the way they do in production: a load asks
for a chunk its lookup never reported (coverage mismatch), and, with tiering, a
promotion started inside ``lookup()`` evicts a chunk already reported as a hit.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingManager,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvobs.vllm.manager import ObservedOffloadingManager

CHUNK_BYTES = 4096
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def observed_manager(inner_spec: str, num_chunks: int, directory: str, engine: str) -> ObservedOffloadingManager:
    """The plugin as vLLM loads it, from a kv_connector_extra_config dict."""
    extra: dict[str, Any] = {
        "spec_name": "ObservedOffloadingSpec",
        "spec_module_path": "kvobs.vllm",
        "kvobs": {"inner_spec": inner_spec, "dir": directory, "engine": engine},
        "cpu_bytes_to_use": num_chunks * CHUNK_BYTES,
    }
    if inner_spec == "TieringOffloadingSpec":
        extra.update(secondary_tiers=[{"type": "example"}], tier_poll_interval_s=0)
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("full",), 0), OffloadingGroupConfig(16, ("swa",), 1, 2)),
        worker_kv_bytes_per_block=CHUNK_BYTES,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id=f"kvobs-demo-{engine}",
        model=OffloadingModelConfig(name="kvobs-demo", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False),
    )
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    assert isinstance(manager, ObservedOffloadingManager)
    return manager


def _key(prefix: int, chunk: int, group: int) -> OffloadKey:
    return make_offload_key(random.Random(prefix * 1_000_003 + chunk).randbytes(32), group)


def run_requests(
    manager: OffloadingManager,
    requests: int,
    seed: int,
    progress: Callable[[int], None],
    on_failure: Callable[[AssertionError], None],
) -> None:
    """Requests over 16 shared prefixes: look up a prefix, load its hits, store the rest.

    With tiering, a lookup that promotes a secondary-tier chunk can evict a hit the
    same pass already reported: the load then asserts, as in vLLM #50014. vLLM
    would die; the demo reports it and goes on.
    """
    rng = random.Random(seed)
    for i in range(requests):
        context = ReqContext(f"req-{i}")
        prefix, length = rng.randrange(16), rng.randint(4, 12)
        keys = [(_key(prefix, c, 0), 16 * (c + 1)) for c in range(length)]
        keys += [(_key(prefix, c, 1), 16 * (c + 1)) for c in range(max(0, length - 2), length)]
        with manager.lock:
            manager.on_new_request(context)
            hits = []
            for key, end in keys:
                context.set_offload_key_position(key, end)
                if manager.lookup(key, context) is not LookupResult.HIT:
                    break
                hits.append(key)
            if hits:
                try:
                    manager.prepare_load(hits, context)
                    manager.complete_load(hits, context)
                except AssertionError as exc:
                    on_failure(exc)
            rest = [k for k, _ in keys if k not in hits]
            out = manager.prepare_store(rest, context)
            if out is not None and out.keys_to_store:
                manager.complete_store(out.keys_to_store, context)
            manager.on_request_finished(context)
            manager.on_schedule_end(ScheduleEndContext(new_req_ids=[context.req_id], preempted_req_ids=()))
        progress(i + 1)


def coverage_mismatch(manager: ObservedOffloadingManager) -> Iterator[AssertionError]:
    """A load asks for a chunk beyond what its lookup covered (never stored)."""
    context = ReqContext("req-coverage")
    with manager.lock:
        manager.on_new_request(context)
        key = _key(99, 0, 1)
        context.set_offload_key_position(key, 2048)
        try:
            manager.prepare_load([key], context)
        except AssertionError as exc:
            yield exc


def promotion_evicts_hit(manager: ObservedOffloadingManager) -> Iterator[AssertionError]:
    """Tiering: a secondary-tier hit is promoted during lookup and evicts a reported primary hit."""
    writer = ReqContext("req-writer")
    with manager.lock:
        manager.on_new_request(writer)
        old = [_key(500, c, 0) for c in range(64)]  # fill more than the primary tier: the oldest go secondary-only
        for key in old:
            out = manager.prepare_store([key], writer)
            if out is not None and out.keys_to_store:
                manager.complete_store(out.keys_to_store, writer)
            manager.on_schedule_end(END)
        context = ReqContext("req-promote")
        manager.on_new_request(context)
        primary_hit = old[-1]
        context.set_offload_key_position(primary_hit, 1024)
        assert manager.lookup(primary_hit, context) is LookupResult.HIT
        policy = manager.cpu_policy
        for victim in old:  # secondary-only chunks are promoted; each promotion evicts a primary chunk
            if policy is None or policy.get(primary_hit) is None:
                break
            manager.lookup(victim, context)
        try:
            manager.prepare_load([primary_hit], context)
        except AssertionError as exc:
            yield exc
