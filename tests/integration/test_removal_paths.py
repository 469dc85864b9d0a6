"""The removal paths vLLM 0.34 made live, through its real connector scheduler (demo.driver).

* A store job the workers report failed: 0.34's connector calls ``complete_store(success=False)`` and
  logs "dropping N chunk(s)"; kvobs records each chunk as a ``store_failed`` removal (path
  ``complete_store``). Before 0.34 a worker had no way to report a failed store job.
* A promotion whose tier fails it with its I/O still in flight (``JobResult.deferred_release``): 0.34's
  tiering drops the keys through the policy and holds their slots (``defer_write_release``, events
  with ``metadata_only=True``); kvobs records them under the reason ``deferred_release``, never
  ``capacity``. A load of such a chunk after its lookup is ``store_failed_after_lookup`` (a failed
  write), named with that reason in the evidence (tests/integration/test_causes.py).

vLLM's connector defers a request whose lookup saw a pending chunk and looks it up again in a later
step, so without a defect no load reaches a chunk these paths removed: the causes they lead to are
tested at the manager, in tests/integration/test_causes.py.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

import pytest

from demo.driver import EngineStepDriver, build_scheduler, make_request, offload_key
from kvobs.vllm import compat
from kvobs.vllm.manager import ObservedOffloadingManager

DOCUMENT = list(range(1000, 1097))  # 6 full blocks of 16 tokens and one token more
OTHER = list(range(3000, 3097))
OBSERVED = {"spec_name": "ObservedOffloadingSpec", "spec_module_path": "kvobs.vllm"}


def release_reports_failed_jobs() -> bool:
    """0.34 and later: workers report failed jobs (``OffloadingWorkerMetadata.failed_jobs``)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

    return any(f.name == "failed_jobs" for f in dataclasses.fields(OffloadingWorkerMetadata))


def observed_manager(scheduler: Any) -> ObservedOffloadingManager:
    manager = scheduler.manager
    assert isinstance(manager, ObservedOffloadingManager), "kvobs observes the connector's manager"
    return manager


def test_a_store_job_the_workers_fail_is_a_store_failed_removal(caplog: pytest.LogCaptureFixture) -> None:
    scheduler, _spec, kv_cache_config = build_scheduler(
        {**OBSERVED, "kvobs": {"inner_spec": "CPUOffloadingSpec"}}, hybrid=False, num_cpu_chunks=16
    )
    driver = EngineStepDriver(scheduler, kv_cache_config)
    try:
        m = observed_manager(scheduler)
        writer = make_request("writer", DOCUMENT)
        driver.step([writer])  # prefill: the connector stores its chunks in this step's metadata
        stores = driver.pending_job_ids
        assert stores, "the writer's chunks go to the workers as a store job"
        reader = make_request("reader", DOCUMENT)
        driver.step([reader])  # its lookup sees the chunks pending (HIT_PENDING): deferred
        assert driver.num_external_tokens["reader"] is None
        key0 = offload_key(writer, 0, 0)
        if not release_reports_failed_jobs():  # 0.30-0.33: the workers cannot say a store failed
            with pytest.raises(compat.ProtocolMismatch, match="cannot report a failed transfer job"):
                driver.report_worker_jobs(stores, failed=stores)
            return
        with caplog.at_level(logging.WARNING):
            driver.report_worker_jobs(stores, failed=stores)
        dropped = [r.getMessage() for r in caplog.records if "dropping" in r.getMessage()]
        assert dropped and re.search(r"failed; dropping (\d+) chunk", dropped[0]), dropped
        n = sum(int(re.search(r"dropping (\d+) chunk", line)[1]) for line in dropped)  # type: ignore[index]
        assert +m.observer.evicted == {"store_failed": n}, "every dropped chunk, under its own reason"
        assert compat.chunk_state(compat.cpu_tier_of(m.inner), key0) == "missing"
        last = m.observer.history.last_removals([key0])[0]
        assert last is not None and last.reason == "store_failed" and last.path == "complete_store"
        driver.step()  # the reader is asked again: a miss now, so it computes (no load, no failure)
        assert driver.num_external_tokens["reader"] == 0 and not m.observer.failures.total()
    finally:
        scheduler.shutdown()


def test_a_promotion_failed_with_a_deferred_release_has_a_reason_of_its_own() -> None:
    scheduler, _spec, kv_cache_config = build_scheduler(
        {**OBSERVED, "kvobs": {"inner_spec": "TieringOffloadingSpec"},
         "secondary_tiers": [{"type": "DeferringTier", "module_path": "tests.support.flaky_tier"}],
         "tier_poll_interval_s": 0},
        hybrid=False, num_cpu_chunks=6,
    )
    driver = EngineStepDriver(scheduler, kv_cache_config)
    try:
        m = observed_manager(scheduler)
        writer, other = make_request("writer", DOCUMENT), make_request("other", OTHER)
        driver.step([writer])
        driver.report_all_worker_jobs()  # stored in the CPU tier; cascaded to the secondary tier
        driver.step([other])
        driver.report_all_worker_jobs()  # the other document's chunks evict the first's (capacity)
        for _ in range(3):
            driver.step()
            driver.report_all_worker_jobs()
        cpu = compat.cpu_tier_of(m.inner)
        key0 = offload_key(writer, 0, 0)
        assert compat.chunk_state(cpu, key0) == "missing", "the document is only in the secondary tier now"
        if not _job_result_defers():  # before 0.34: a tier cannot defer a release, nothing to hook
            assert not hasattr(cpu, compat.DEFERRED_RELEASE_METHOD)
            return
        reader = make_request("reader", DOCUMENT)
        driver.step([reader])  # lookup: a promotion, which the tier fails; the step's end processes it
        assert driver.num_external_tokens["reader"] is None, "the request waits for its promotion"
        tier = m.inner.secondary_tiers[0]
        assert tier.released, "the step's end submitted the promotion, which the tier failed"
        driver.step()  # the reader's next lookup processes the failure first: the keys leave, slots held
        assert cpu.num_deferred_release_chunks > 0
        assert m.observer.evicted["deferred_release"] == cpu.num_deferred_release_chunks, \
            "each chunk vLLM holds for the tier, counted once under its own reason"
        last = m.observer.history.last_removals([key0])[0]
        assert last is not None and last.reason == "deferred_release" and last.path == "lookup"
        for event in tier.released:
            event.set()
    finally:
        scheduler.shutdown()


def _job_result() -> type:
    from vllm.v1.kv_offload.tiering.base import JobResult

    return JobResult


def _job_result_defers() -> bool:
    return "deferred_release" in {f.name for f in dataclasses.fields(_job_result())}
