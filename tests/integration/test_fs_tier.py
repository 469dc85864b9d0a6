"""The production configuration, for real, on every supported release.

vLLM's real ``FileSystemTierManager`` behind the CPU tier (files in a temporary directory, its I/O
thread pool and async lookups), a Gemma-style hybrid model with six KV groups (1 full attention,
5 sliding window), through vLLM's real ``OffloadingConnectorScheduler`` with kvobs plugged in as
``ObservedOffloadingSpec``. Nothing is injected: each failure comes from vLLM's own code, and
which release fails is part of what is tested (demo/incidents.py says which and why). Where
a release does not fail, kvobs must still have seen what happened: promotions evicting chunks
from inside ``lookup()``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

from demo.driver import EngineStepDriver, build_scheduler
from demo.incidents import (
    MTP_RETAINED_TOKENS,
    PRODUCTION,
    PRODUCTION_CPU_CHUNKS,
    fs_tier,
    promotion_after_deferral,
    promotion_evicts_hit,
)
from kvobs.sidecar.ingest import Ingest
from kvobs.sidecar.metrics import KvobsCollector
from kvobs.tracing import TracingSink
from kvobs.wire.decode import iter_reports
from tests.support.scheduler_harness import DOCUMENT, FILLERS
from tests.support.vllm_env import VLLM, create_spec, key, observed_extra


def observed_fs(tmp_path: Path, **build: Any) -> tuple[Any, EngineStepDriver]:
    extra = {
        **fs_tier(str(tmp_path / "fs")),
        "spec_name": "ObservedOffloadingSpec", "spec_module_path": "kvobs.vllm",
        "kvobs": {"inner_spec": "TieringOffloadingSpec", "engine": "dp0", "dir": str(tmp_path / "kvobs")},
    }
    scheduler, _, kv_cache_config = build_scheduler(extra, **build)
    return scheduler, EngineStepDriver(scheduler, kv_cache_config)


def run(driver: EngineStepDriver, replay: Any, *args: Any) -> AssertionError | None:
    try:
        replay(driver, *args)
    except AssertionError as exc:
        return exc
    return None


def removals_by_path(scheduler: Any) -> dict[str, int]:
    history = scheduler.manager.observer.history
    out: dict[str, int] = {}
    for serial in range(history.next_serial):
        removal = history.removal_at(serial)
        if removal is not None:
            out[removal.path] = out.get(removal.path, 0) + 1
    return out


def test_a_promotion_after_a_deferred_lookup_evicts_a_counted_hit(tmp_path: Path) -> None:
    scheduler, driver = observed_fs(tmp_path, **PRODUCTION, num_cpu_chunks=PRODUCTION_CPU_CHUNKS)
    try:
        error = run(driver, promotion_after_deferral, DOCUMENT, FILLERS)
        paths = removals_by_path(scheduler)
        assert paths.get("lookup", 0) > 0  # promotions evicted from inside lookup(): kvobs saw them
        observer = scheduler.manager.observer
        if VLLM >= (0, 33):  # 0.33's request-rank LRU evicts another chunk: no failure to explain
            assert error is None
            assert observer.failures.total() == 0
            return
        assert error is not None
        text = str(error)
        assert re.match(r"Chunk b.* not found in cache \(group=0, req_id='c'\)\. 1 of 15 keys", text), text
        assert "cause: evicted_after_lookup (lookup reported HIT" in text and "path=lookup, req_id='c'" in text
        assert observer.near_misses["capacity"] == 1 and observer.failures["evicted_after_lookup"] == 1
    finally:
        scheduler.shutdown()
    # The failure reached the sidecar: its report, and the counters.
    ingest = Ingest(tmp_path / "kvobs")
    ingest.poll()
    engine = ingest.state.engines[("kvobs/cpu-harness", "dp0")]  # the harness's model path, as vLLM names it
    assert engine.totals()["failures"]["evicted_after_lookup"] == 1
    assert engine.missing == {("evicted_after_lookup", "0"): 1}
    families = {family.name: family for family in KvobsCollector(ingest).collect()}
    failures = {s.labels["cause"]: s.value for s in families["kvobs_load_failures"].samples}
    assert failures["evicted_after_lookup"] == 1


def test_mtp_retained_history_is_a_coverage_mismatch_on_0_30_only(tmp_path: Path) -> None:
    """vLLM #56701 (MTP-retained sliding-window history the lookup never checks), the likely class of vLLM
    #54914 (docs/vllm.md, "The reported classes, by release"): it still kills 0.30.0's engine, with nothing
    injected. What an operator gets for it: the message, the failure report, the span, the counter at the
    sidecar, and ``kvobs explain`` of the logged assertion with the directory."""
    scheduler, driver = observed_fs(tmp_path, **PRODUCTION, extra_retained_tokens=MTP_RETAINED_TOKENS,
                                    num_cpu_chunks=40)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    observer = scheduler.manager.observer
    for sink in observer.sinks:
        if isinstance(sink, TracingSink):
            sink._given = provider  # the test's provider: what any exporter would get
    try:
        error = run(driver, promotion_after_deferral, DOCUMENT, FILLERS)
        if VLLM >= (0, 31):  # #56709: the connector's lookup window counts the retained tokens
            assert error is None and observer.failures.total() == 0
            assert removals_by_path(scheduler).get("lookup", 0) > 0
            return
        assert error is not None
        text = str(error)
        assert "(group=1, req_id='c'). 5 of 20 keys in this load are missing" in text, text
        assert "cause: coverage_mismatch (this request's lookups never reported the chunk" in text
        assert observer.failures["coverage_mismatch"] == 1
    finally:
        scheduler.shutdown()
    directory = tmp_path / "kvobs"
    (report,) = list(iter_reports(directory / "failures"))
    assert (report["cause"], report["group"], report["req_id"]) == ("coverage_mismatch", 1, "c")
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "kv_offload.prepare_load"]
    assert span.attributes is not None and span.attributes["kv_offload.cause"] == "coverage_mismatch"
    ingest = Ingest(directory)
    ingest.poll()
    families = {family.name: family for family in KvobsCollector(ingest).collect()}
    failures = {s.labels["cause"]: s.value for s in families["kvobs_load_failures"].samples}
    assert failures["coverage_mismatch"] == 1
    log = tmp_path / "engine.log"
    log.write_text(f"(EngineCore_DP0 pid=1) ERROR 12-07 05:00:00 [core.py:1] AssertionError: {text}\n")
    told = subprocess.run([sys.executable, "-m", "kvobs.cli", "explain", "--dir", str(directory), str(log)],
                          capture_output=True, text=True, timeout=120)
    assert told.returncode == 0, told.stderr
    assert "coverage_mismatch" in told.stdout and report["id"] in told.stdout, told.stdout


def test_vllm_50014_with_the_fs_tier(tmp_path: Path) -> None:
    """The #50014 pattern with the real fs tier (its first lookup answers RETRY: one step later)."""
    scheduler, driver = observed_fs(tmp_path, hybrid=True, num_cpu_chunks=12)
    try:
        error = run(driver, promotion_evicts_hit, DOCUMENT, FILLERS[0][:32])
        if VLLM < (0, 31):  # 0.30's connector touches c's chunks while it is deferred: another chunk goes
            assert error is None
            return
        assert error is not None
        assert "cause: evicted_after_lookup" in str(error) and "path=lookup, req_id='c'" in str(error)
    finally:
        scheduler.shutdown()


def test_a_failed_fs_read_is_a_store_failed_removal_and_names_its_cause(managers: list[Any], tmp_path: Path) -> None:
    """The promotion's read fails (its file is gone): vLLM removes the not-ready slot through
    ``policy.remove``; kvobs records it, and a load of that chunk is ``store_failed_after_lookup``."""
    spec = create_spec(observed_extra({"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 4 * 4096,
                                       **fs_tier(str(tmp_path))}))
    m = spec.get_manager()
    managers.append(m)
    fs = m.inner.secondary_tiers[0]
    end = ScheduleEndContext(new_req_ids=[], preempted_req_ids=())

    def step_end() -> None:
        m.on_schedule_end(end)
        driver_settle(m)

    w = ReqContext("w")
    m.on_new_request(w)
    for i in range(1, 6):  # key(5) evicts key(1) from the CPU tier; the fs tier keeps it
        m.prepare_store([key(i)], w)
        m.complete_store([key(i)], w)
        step_end()
    r = ReqContext("r")
    m.on_new_request(r)
    assert m.lookup(key(1), r) is LookupResult.RETRY  # the fs tier's first answer: ask again
    step_end()
    assert m.lookup(key(1), r) is LookupResult.HIT_PENDING  # found in fs: promotion started
    os.remove(fs.file_mapper.get_file_name(key(1)))  # the block disappears before the read
    step_end()
    m.prepare_store([], w)  # the step's first store polls the tiers: the failed read is seen here
    assert m.observer.evicted["store_failed"] == 1
    with pytest.raises(AssertionError, match=r"cause: store_failed_after_lookup \(lookup reported HIT_PENDING"):
        m.prepare_load([key(1)], r)


def driver_settle(manager: Any) -> None:
    from kvobs.vllm import compat

    compat.settle_secondary_tiers(manager)
