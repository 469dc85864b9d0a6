"""Real vLLM offloading objects (0.30.0 to 0.34.0, whichever is installed) built on CPU, for the tests.

Specs are created through vLLM's own ``OffloadingSpecFactory.create_spec`` from an
``OffloadingConfig`` whose ``extra_config`` is what a user writes in
``kv_connector_extra_config``; managers come from ``spec.get_manager()``. Nothing
here is faked: tiering uses vLLM's ``ExampleSecondaryTierManager`` (an in-memory
tier) and a scheduler-side ``SharedOffloadRegion`` in /dev/shm, freed by shutdown.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from vllm.v1.kv_offload.base import OffloadingManager, OffloadingSpec, OffloadKey, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvobs.vllm import compat

BYTES_PER_CHUNK = 4096  # one page: the smallest aligned chunk
VLLM = tuple(int(part) for part in compat.VLLM_VERSION.split(".")[:2])
"""The installed release, (major, minor): what a test expects of vLLM itself may differ by release."""


def set_position(context: Any, k: bytes, end_token: int) -> None:
    """Record a chunk's end token as the connector does (0.31 and later; 0.30 keeps none)."""
    if compat.HAS_KEY_POSITIONS:
        context.set_offload_key_position(k, end_token)


def end_token(value: int) -> int | None:
    """The end token the message shows for a chunk recorded at ``value`` (None before 0.31)."""
    return value if compat.HAS_KEY_POSITIONS else None


def token_range(text: str) -> str:
    """The load end_token range the message shows ("unknown" before 0.31)."""
    return text if compat.HAS_KEY_POSITIONS else "unknown"

_engine_ids = itertools.count()


def offloading_config(extra_config: dict[str, Any], *, groups: int = 1, dp_index: int = 0) -> OffloadingConfig:
    """An OffloadingConfig for a tiny single-worker engine on CPU (DP rank ``dp_index``)."""
    return OffloadingConfig(
        groups=tuple(
            OffloadingGroupConfig(tokens_per_block=16, layer_names=(f"layer.{g}",), group_id=g)
            for g in range(groups)
        ),
        worker_kv_bytes_per_block=BYTES_PER_CHUNK,
        enable_kv_cache_events=bool(extra_config.pop("_events", False)),
        extra_config=extra_config,
        engine_id=f"kvobs-test-{os.getpid()}-{next(_engine_ids)}",
        model=OffloadingModelConfig(name="kvobs-test", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=dp_index, data_parallel_size=dp_index + 1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


def cpu_extra(num_chunks: int, **more: Any) -> dict[str, Any]:
    return {"cpu_bytes_to_use": num_chunks * BYTES_PER_CHUNK, **more}


def tiering_extra(num_chunks: int, **more: Any) -> dict[str, Any]:
    return {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": num_chunks * BYTES_PER_CHUNK,
        "secondary_tiers": [{"type": "example"}],
        "tier_poll_interval_s": 0,
        **more,
    }


def observed_extra(inner: dict[str, Any], **kvobs_options: Any) -> dict[str, Any]:
    """The plugin's extra_config wrapping ``inner`` (the DESIGN.md form)."""
    inner = dict(inner)
    inner_spec = inner.pop("spec_name", "CPUOffloadingSpec")
    return {
        **inner,
        "spec_name": "ObservedOffloadingSpec",
        "spec_module_path": "kvobs.vllm",
        "kvobs": {"inner_spec": inner_spec, **kvobs_options},
    }


def create_spec(extra_config: dict[str, Any], *, groups: int = 1, dp_index: int = 0) -> OffloadingSpec:
    return OffloadingSpecFactory.create_spec(offloading_config(dict(extra_config), groups=groups, dp_index=dp_index))


def create_manager(extra_config: dict[str, Any], *, groups: int = 1) -> OffloadingManager:
    return create_spec(extra_config, groups=groups).get_manager()


def key(i: int, group: int = 0) -> OffloadKey:
    return make_offload_key(i.to_bytes(32, "big"), group)


def evicted_after_lookup_then_coverage_mismatch(
    manager: OffloadingManager, writer: Any, victim: Any, pause_s: float = 0.0
) -> None:
    """On a 4-chunk CPU tier: 20 capacity evictions over KV groups 0 and 1 (``pause_s`` between
    rounds spreads residencies), one of them of a chunk ``victim``'s lookup reported (a near miss),
    then two failed loads: ``evicted_after_lookup`` and ``coverage_mismatch`` (group 1)."""
    import time

    import pytest

    for i in range(10):
        keys = [key(100 + 2 * i), key(101 + 2 * i, group=1)]
        manager.prepare_store(keys, writer)
        manager.complete_store(keys, writer)
        if pause_s:
            time.sleep(pause_s)
    set_position(victim, key(118), 160)
    assert manager.lookup(key(118), victim).name == "HIT"
    for i in range(2):  # evicts key(118) after the victim's lookup
        keys = [key(500 + 2 * i), key(501 + 2 * i, group=1)]
        manager.prepare_store(keys, writer)
        manager.complete_store(keys, writer)
    with pytest.raises(AssertionError, match="cause: evicted_after_lookup"):
        manager.prepare_load([key(118)], victim)
    with pytest.raises(AssertionError, match="cause: coverage_mismatch"):
        manager.prepare_load([key(999, group=1)], victim)
