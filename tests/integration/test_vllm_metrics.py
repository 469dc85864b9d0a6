"""The ``vllm_metrics`` option: kvobs's live counters on vLLM's own /metrics, recorded by vLLM.

Real parts throughout: vLLM's ``OffloadingConnectorScheduler`` (``demo.driver``) with
kvobs plugged in as ``ObservedOffloadingSpec`` around ``TieringOffloadingSpec`` and vLLM's real
fs tier, the scheduler's own ``get_stats()`` each step, and vLLM's own ``KVConnectorProm`` (what
the API server's stat logger records the stats with, vllm/v1/metrics/loggers.py) into
prometheus_client's default registry, cleared before and after with vLLM's own
``unregister_vllm_metrics``. The load failure comes from vLLM's own code: a release-dependent
request pattern from demo/incidents.py. Off (the default), kvobs declares and reports
exactly what the inner spec and manager do.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY, generate_latest
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import get_connector_metric_definitions
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.metrics.prometheus import unregister_vllm_metrics

from demo.driver import EngineStepDriver, build_scheduler
from demo.incidents import (
    PRODUCTION,
    PRODUCTION_CPU_CHUNKS,
    fs_tier,
    promotion_after_deferral,
    promotion_evicts_hit,
)
from demo.workload import Traffic, Workload
from kvobs.codes import CAUSES, REASONS
from kvobs.options import OptionError, parse_options
from kvobs.vllm import ObservedOffloadingManager, compat, vllm_metrics
from kvobs.vllm.modelless_config import make_vllm_config
from tests.support.scheduler_harness import DOCUMENT, FILLERS
from tests.support.twin_driver import stats_shape
from tests.support.vllm_env import VLLM, cpu_extra, create_spec, observed_extra, tiering_extra

SERIES = {
    "vllm:kv_offload_kvobs_evicted_chunks_total": ("reason", REASONS, "evicted"),
    "vllm:kv_offload_kvobs_load_failures_total": ("cause", CAUSES, "failures"),
    "vllm:kv_offload_kvobs_hits_evicted_before_load_total": ("reason", REASONS, "near_misses"),
}
"""The series on vLLM's /metrics: label, its values, and the Observer counter they must equal."""
UNAVAILABLE = "vllm:kv_offload_kvobs_unavailable"
"""And the gauge only vLLM's /metrics carries (tests/integration/test_bad_settings.py sets it to 1)."""


def ordinary_traffic(driver: EngineStepDriver, *, seed: int, steps: int) -> Iterator[int]:
    """The demo's chat and document traffic, one engine step per iteration: new requests, the
    worker's jobs done, about a third of the running requests finished."""
    rng = random.Random(seed)
    traffic = Traffic(rng, Workload(), "v")
    for step in range(steps):
        driver.step([traffic.next_request() for _ in range(rng.randint(0, 2))])
        driver.report_all_worker_jobs()
        for request in driver.running:
            if rng.random() < 0.3:
                driver.finish(request)
                traffic.finished(request)
        yield step


@pytest.fixture
def vllm_registry() -> Iterator[None]:
    unregister_vllm_metrics()  # what vLLM's PrometheusStatLogger does before registering its own
    yield
    unregister_vllm_metrics()


def plugin_extra(tmp_path: Path, **kvobs_options: Any) -> dict[str, Any]:
    return {
        **fs_tier(str(tmp_path / "fs")),
        "spec_name": "ObservedOffloadingSpec", "spec_module_path": "kvobs.vllm",
        "kvobs": {"inner_spec": "TieringOffloadingSpec", **kvobs_options},
    }


def replay_failure(driver: EngineStepDriver) -> None:
    """A request pattern on which this release's own code fails a load (demo/incidents.py)."""
    if VLLM >= (0, 33):
        promotion_evicts_hit(driver, DOCUMENT, FILLERS[0][:32])
    else:
        promotion_after_deferral(driver, DOCUMENT, FILLERS)


def test_kvobs_counters_on_vllms_own_metrics(tmp_path: Path, vllm_registry: None) -> None:
    extra = plugin_extra(tmp_path, vllm_metrics=True)
    build = PRODUCTION if VLLM < (0, 33) else {"hybrid": True}
    chunks = PRODUCTION_CPU_CHUNKS if VLLM < (0, 33) else 12
    scheduler, _, kv_cache_config = build_scheduler(extra, **build, num_cpu_chunks=chunks)
    try:
        manager = scheduler.manager
        assert isinstance(manager, ObservedOffloadingManager)
        observer = manager.observer
        labels = {"model_name": observer.options.model_name, "engine": observer.options.engine}
        assert labels == {"model_name": "kvobs/cpu-harness", "engine": "0"}  # vLLM's values (served name, DP index)
        vllm_config = make_vllm_config(extra)
        # The API server's side: the spec class named in the same extra_config declares the metrics.
        declared = OffloadingSpecFactory.get_spec_cls(extra).build_metric_definitions(extra)
        assert set(vllm_metrics.metric_definitions(observer.options)) <= set(declared)
        known = {*declared, *get_connector_metric_definitions()}  # what OffloadPromMetrics registers
        prom = KVConnectorProm(vllm_config, ["model_name", "engine"], {0: [labels["model_name"], labels["engine"]]})
        log_stats = KVConnectorLogging(vllm_config.kv_transfer_config)  # vLLM's LoggingStatLogger's part
        payloads: list[dict[str, Any]] = []

        def engine_stats() -> None:  # what EngineCore sends and the API server's stat logger records
            stats = scheduler.get_stats()
            if stats is not None and not stats.is_empty():
                assert set(stats.data["data"]) <= known  # OffloadPromMetrics asserts this
                payloads.append(stats.data)
                prom.observe(stats.data, 0)
                log_stats.observe(stats.data)

        failures: list[AssertionError] = []
        driver = EngineStepDriver(scheduler, kv_cache_config, on_load_failure=lambda exc, request: failures.append(exc))
        step = driver.step

        def step_and_report(admit: Iterable[Any] = ()) -> Any:  # EngineCore: stats after every step
            meta = step(admit)
            engine_stats()
            return meta

        driver.step = step_and_report  # type: ignore[method-assign]
        engine_stats()  # before any traffic: every series at 0
        first = {name: dict(by_labels) for name, by_labels in payloads[0]["data"].items()
                 if name.startswith(vllm_metrics.PREFIX)}
        assert first == {**{name.removesuffix("_total"): {(value,): 0 for value in values}
                            for name, (_, values, _) in SERIES.items()},
                         UNAVAILABLE: {("dir",): 0, ("flight_recorder",): 0}}  # all there, nothing unavailable

        replay_failure(driver)
        for _ in ordinary_traffic(driver, seed=7, steps=40):  # more evictions, reported as increments
            pass
        engine_stats()

        assert len(failures) == 1 and "cause: evicted_after_lookup" in str(failures[0])
        assert observer.failures["evicted_after_lookup"] == 1 and observer.near_misses["capacity"] >= 1
        assert observer.evicted["capacity"] > 0
        for name, (label, values, counter) in SERIES.items():
            counts = getattr(observer, counter)
            for value in values:
                sample = REGISTRY.get_sample_value(name, {**labels, label: value})
                assert sample == counts[value], (name, value)
        # Only increments travel after the first payload: a later one never repeats an unmoved series.
        load_failures = "vllm:kv_offload_kvobs_load_failures"
        assert all((load_failures not in p["data"]) or sum(p["data"][load_failures].values()) for p in payloads[1:])
        text = generate_latest(REGISTRY).decode()
        names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if not line.startswith("#")}
        assert {name for name in names if "kvobs" in name and not name.endswith("_created")} == {*SERIES, UNAVAILABLE}
        assert ('vllm:kv_offload_kvobs_load_failures_total{cause="evicted_after_lookup",engine="0",'
                'model_name="kvobs/cpu-harness"} 1.0') in text
        assert not any(name.startswith("kvobs_") for name in names)  # never the sidecar's names
        logged: list[str] = []
        log_stats.log(log_fn=lambda fmt, *args: logged.append(fmt % args))
        assert len(logged) == 1 and "vllm:kv_offload_kvobs_load_failures:('evicted_after_lookup',)=1" in logged[0]
        # vLLM rebuilds its stat logger after unregistering every vllm:* collector: kvobs's go too.
        unregister_vllm_metrics()
        KVConnectorProm(vllm_config, ["model_name", "engine"], {0: [labels["model_name"], labels["engine"]]})
    finally:
        scheduler.shutdown()


def test_default_off_reports_exactly_what_the_inner_spec_does() -> None:
    for inner in (cpu_extra(4), tiering_extra(4)):
        for kvobs_options in ({}, {"vllm_metrics": False}):
            extra = observed_extra(inner, **kvobs_options)
            spec_cls = OffloadingSpecFactory.get_spec_cls(extra)
            bare_cls = OffloadingSpecFactory.get_spec_cls(inner)
            assert spec_cls.build_metric_definitions(extra) == bare_cls.build_metric_definitions(inner)
            manager = create_spec(extra).get_manager()
            try:
                assert isinstance(manager, ObservedOffloadingManager)
                assert manager.get_stats == manager.inner.get_stats  # the inner manager's own bound method
            finally:
                manager.shutdown()
    # Through the real scheduler: the same traffic, the same stats, step by step (vLLM's in-memory
    # example tier: the fs tier's threads make two bare runs differ on 0.30).
    bare_extra = tiering_extra(0)
    del bare_extra["cpu_bytes_to_use"]  # build_scheduler sizes the CPU tier
    runs = []
    for extra in (bare_extra, observed_extra(bare_extra)):
        scheduler, _, kv_cache_config = build_scheduler(extra, hybrid=True, num_cpu_chunks=12)
        try:
            driver = EngineStepDriver(scheduler, kv_cache_config, on_load_failure=lambda exc, request: None)
            shapes = []
            for _ in ordinary_traffic(driver, seed=11, steps=30):
                stats = scheduler.get_stats()
                shapes.append(None if stats is None else stats_shape(stats.data))
            runs.append(shapes)
        finally:
            scheduler.shutdown()
    assert any(runs[0]) and runs[0] == runs[1]
    assert not any(name.startswith(vllm_metrics.PREFIX) for shape in runs[1] if shape for name in shape[1])


@pytest.mark.parametrize("value", ["true", 1, 0, None, [True]])
def test_a_bad_value_is_refused_naming_the_option(value: Any) -> None:
    pattern = "kvobs option 'vllm_metrics' must be true or false"
    extra = observed_extra(cpu_extra(2), vllm_metrics=value)
    with pytest.raises(OptionError, match=pattern):
        create_spec(extra)
    with pytest.raises(OptionError, match=pattern):  # the API server's path
        OffloadingSpecFactory.get_spec_cls(extra).build_metric_definitions(extra)
    with pytest.raises(OptionError, match=r"kvobs.observe\(\) option 'vllm_metrics' must be true or false"):
        parse_options({"vllm_metrics": value}, source="kvobs.observe() option")


def test_a_release_without_the_api_warns_once_and_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(compat, "offload_stats_api", lambda: "vLLM x has no OffloadingSpec.build_metric_definitions")
    monkeypatch.setattr(vllm_metrics, "_warned", False)
    inner = tiering_extra(4)
    extra = observed_extra(inner, vllm_metrics=True)
    with caplog.at_level(logging.WARNING, logger="kvobs"):
        declared = OffloadingSpecFactory.get_spec_cls(extra).build_metric_definitions(extra)
        manager = create_spec(extra).get_manager()
    try:
        assert declared == OffloadingSpecFactory.get_spec_cls(inner).build_metric_definitions(inner)
        assert isinstance(manager, ObservedOffloadingManager)
        assert manager.get_stats == manager.inner.get_stats
    finally:
        manager.shutdown()
    warnings = [r.getMessage() for r in caplog.records if "vllm_metrics" in r.getMessage()]
    assert warnings == ["kvobs option 'vllm_metrics' does nothing here: vLLM x has no "
                        "OffloadingSpec.build_metric_definitions; kvobs's counters stay on its sidecar only"]


def test_a_fault_of_kvobs_leaves_the_inner_stats_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    extra = observed_extra(tiering_extra(4), vllm_metrics=True)
    manager = create_spec(extra).get_manager()
    try:
        assert isinstance(manager, ObservedOffloadingManager)
        assert isinstance(manager.get_stats.func, vllm_metrics.StatsTap)  # inside kvobs.vllm.signatures.dressed

        def broken(self: Any) -> Any:
            raise RuntimeError("kvobs bug")

        monkeypatch.setattr(vllm_metrics.StatsTap, "totals", broken)
        stats = manager.get_stats()
        assert stats is not None and not any(name.startswith(vllm_metrics.PREFIX) for name in stats.data["data"])
        assert manager.observer.internal_errors["sink"] == 1
    finally:
        manager.shutdown()
