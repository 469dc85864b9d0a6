"""An observability plugin never stops an engine: on what kvobs does not know, it steps aside.

The unknown protocol here is real vLLM code: an out-of-tree cache policy loaded by vLLM's own
mechanism (tests/support/changed_protocol.py). Through the plugin, the engine gets vLLM's
manager unobserved, one warning says why, and the sidecar exports ``kvobs_observing 0``;
``kvobs.observe()`` called directly refuses with an error naming what is missing.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

import kvobs
from kvobs.sidecar.ingest import Ingest
from kvobs.sidecar.metrics import KvobsCollector
from kvobs.vllm import ObservedOffloadingManager, compat
from tests.support.vllm_env import cpu_extra, create_manager, create_spec, key, observed_extra

UNKNOWN_POLICY = {"eviction_policy": "WrappedLRUPolicy", "cache_policy_module_path": "tests.support.changed_protocol"}


def test_the_plugin_steps_aside_and_vllm_runs_as_without_kvobs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = create_spec(observed_extra(cpu_extra(2, **UNKNOWN_POLICY), dir=str(tmp_path), engine="dp0"))
    with caplog.at_level(logging.WARNING, logger="kvobs"):
        manager = spec.get_manager()
    try:
        assert type(manager) is CPUOffloadingManager and not isinstance(manager, ObservedOffloadingManager)
        warnings = [r.getMessage() for r in caplog.records if r.name == "kvobs" and r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "steps aside" in warnings[0] and compat.VLLM_VERSION in warnings[0]
        assert "chunks" in warnings[0]  # what is missing: the policy's tables kvobs reads at a reset
        # vLLM serves: a load fails with its own assertion, untouched.
        a, b = ReqContext("req-a"), ReqContext("req-b")
        manager.prepare_store([key(1), key(2)], a)
        manager.complete_store([key(1), key(2)], a)
        assert manager.lookup(key(1), a) is LookupResult.HIT
        manager.prepare_store([key(3), key(4)], b)  # evicts key(1)
        with pytest.raises(AssertionError) as failed:
            manager.prepare_load([key(1)], a)
        assert str(failed.value) == f"Chunk {key(1)!r} not found in cache"
    finally:
        manager.shutdown()
    ingest = Ingest(tmp_path)
    ingest.poll()
    families = {family.name: family for family in KvobsCollector(ingest).collect()}
    [sample] = families["kvobs_observing"].samples
    labels = {"model_name": "kvobs-test", "engine": "dp0", "reason": "unsupported_vllm"}
    assert (sample.labels, sample.value) == (labels, 0)


def test_observe_called_directly_names_what_it_does_not_know(managers: list[Any]) -> None:
    inner = create_manager(cpu_extra(2, **UNKNOWN_POLICY))
    managers.append(inner)
    with pytest.raises(compat.ProtocolMismatch, match="WrappedLRUPolicy keeps its chunks in none of chunks, t1, t2"):
        kvobs.observe(inner)


def test_an_observed_engine_says_it_observes(tmp_path: Path) -> None:
    spec = create_spec(observed_extra(cpu_extra(2), dir=str(tmp_path), engine="dp0"))
    manager = spec.get_manager()
    manager.shutdown()
    ingest = Ingest(tmp_path)
    ingest.poll()
    families = {family.name: family for family in KvobsCollector(ingest).collect()}
    [sample] = families["kvobs_observing"].samples
    assert (sample.labels, sample.value) == ({"model_name": "kvobs-test", "engine": "dp0", "reason": "ok"}, 1)
