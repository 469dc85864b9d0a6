"""Mistakes that are loud (issue 41): an unusable directory, a recorder that cannot run, settings vLLM refuses.

Real parts: vLLM's ``OffloadingConnectorScheduler`` built as ``OffloadingConnector`` builds it
(``demo.driver.build_scheduler``) or vLLM's spec factory, with kvobs plugged in as
``ObservedOffloadingSpec``; vLLM's own ``KVConnectorProm`` records the scheduler's stats into
prometheus_client's registry (as the API server's stat logger does); real directories that kvobs cannot use
(``/proc``, a file, a path under a file: the tests run as any uid, root included); ``kvobs doctor``'s
``diagnose`` with vLLM's own validation. What each asserts: one WARNING naming the option or env var, the
path, the error and what is off; exactly one INFO line per engine; the gauge's value on vLLM's /metrics;
the doctor's findings and exit status.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.metrics.prometheus import unregister_vllm_metrics

from demo.driver import build_scheduler
from kvobs.journal import DIR_LOST
from kvobs.vllm import ObservedOffloadingManager
from kvobs.vllm.doctor import CONFIG_ERROR, OBSERVES, diagnose
from kvobs.vllm.modelless_config import make_vllm_config
from tests.support.vllm_env import VLLM, cpu_extra, create_spec, observed_extra, tiering_extra

GAUGE = "vllm:kv_offload_kvobs_unavailable"


def kvobs_records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvobs" and r.levelno == level]


def not_a_dir(tmp_path: Path) -> str:
    (tmp_path / "file").write_text("x")
    return str(tmp_path / "file")


def under_a_file(tmp_path: Path) -> str:
    (tmp_path / "file").write_text("x")
    return str(tmp_path / "file" / "kvobs")


@pytest.mark.parametrize("where", [lambda _: "/proc/kvobs", lambda _: "/proc", not_a_dir, under_a_file],
                         ids=["proc-missing", "proc", "a-file", "under-a-file"])
@pytest.mark.parametrize("source", ["option", "env"])
def test_an_unusable_directory_is_one_warning_naming_it_and_the_engine_runs(
    where: Any, source: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = where(tmp_path)
    if source == "env":
        monkeypatch.setenv("KVOBS_DIR", path)
        extra = observed_extra(cpu_extra(4))
    else:
        monkeypatch.delenv("KVOBS_DIR", raising=False)
        extra = observed_extra(cpu_extra(4), dir=path)
    with caplog.at_level(logging.INFO, logger="kvobs"):
        manager = create_spec(extra).get_manager()
        try:
            assert isinstance(manager, ObservedOffloadingManager)  # observed all the same, in-process
            assert manager.observer.unavailable() == {"dir": True, "flight_recorder": False}
            assert not any(sink.stage == "journal" for sink in manager.observer.sinks)
            assert manager.observer.internal_errors["journal"] == 1  # counted as before; said once, below
        finally:
            manager.shutdown()
    warnings = kvobs_records(caplog, logging.WARNING)
    assert len(warnings) == 1, warnings
    named = "env KVOBS_DIR" if source == "env" else "kvobs option 'dir'"
    assert f"the directory {path!r} ({named}) is unusable: " in warnings[0]
    assert "Error: " in warnings[0] and DIR_LOST in warnings[0]  # the error, and what is off
    assert not kvobs_records(caplog, logging.ERROR)  # no "kvobs internal error in journal"
    infos = [m for m in kvobs_records(caplog, logging.INFO) if m.startswith("kvobs observes")]
    assert len(infos) == 1 and f"directory {path!r} ({named}) UNUSABLE" in infos[0], infos
    if path.startswith("/proc"):
        assert not Path("/proc/kvobs").exists()


def test_a_healthy_start_is_one_info_line_and_no_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "new" / "kvobs"
    monkeypatch.setenv("KVOBS_DIR", str(directory))
    with caplog.at_level(logging.INFO, logger="kvobs"):
        managers = [create_spec(observed_extra(cpu_extra(4), flight_calls=2_000, vllm_metrics=True)).get_manager()
                    for _ in range(2)]  # two engines: one line each
        try:
            for manager in managers:
                assert manager.observer.unavailable() == {"dir": False, "flight_recorder": False}
        finally:
            for manager in managers:
                manager.shutdown()
    assert not kvobs_records(caplog, logging.WARNING) and not kvobs_records(caplog, logging.ERROR)
    infos = [m for m in kvobs_records(caplog, logging.INFO) if m.startswith("kvobs observes")]
    assert len(infos) == 2, infos
    assert infos[0].startswith("kvobs observes CPUOffloadingManager on vLLM ")
    for part in (f"directory {str(directory)!r} (env KVOBS_DIR)", "flight recorder on (flight_calls=2000",
                 "survive off", "vllm_metrics on", "history_size 1000000", "hot path "):
        assert part in infos[0], (part, infos[0])
    assert (directory / "journal").is_dir() and oct(directory.stat().st_mode & 0o777) == "0o700"
    assert not [p for p in directory.rglob(".kvobs-probe-*")]  # the probe's files are gone


def test_the_same_spec_logs_its_line_once(caplog: pytest.LogCaptureFixture) -> None:
    spec = create_spec(observed_extra(cpu_extra(4)))
    with caplog.at_level(logging.INFO, logger="kvobs"):
        manager = spec.get_manager()
        assert spec.get_manager() is manager  # vLLM may ask again: the one manager, no second line
        manager.shutdown()
    assert len([m for m in kvobs_records(caplog, logging.INFO) if m.startswith("kvobs observes")]) == 1


def test_a_flight_recorder_that_cannot_run_is_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvobs"):
        manager = create_spec(observed_extra(tiering_extra(4), flight_calls=2_000)).get_manager()
        try:
            assert manager.observer.unavailable() == {"dir": False, "flight_recorder": True}
        finally:
            manager.shutdown()
    warnings = kvobs_records(caplog, logging.WARNING)
    assert len(warnings) == 1 and "no flight recorder on this engine" in warnings[0], warnings
    infos = [m for m in kvobs_records(caplog, logging.INFO) if m.startswith("kvobs observes")]
    assert len(infos) == 1 and "flight recorder asked for (flight_calls=2000) but OFF" in infos[0], infos


@pytest.fixture
def vllm_registry() -> Iterator[None]:
    unregister_vllm_metrics()  # what vLLM's PrometheusStatLogger does before registering its own
    yield
    unregister_vllm_metrics()


@pytest.mark.parametrize("usable", [False, True], ids=["proc", "usable"])
def test_the_gauge_on_vllms_metrics_says_the_directory_is_unusable(
    usable: bool, tmp_path: Path, vllm_registry: None
) -> None:
    path = str(tmp_path / "kvobs") if usable else "/proc/kvobs"
    extra = observed_extra({}, dir=path, vllm_metrics=True, flight_calls=2_000)
    scheduler, _, _ = build_scheduler(extra, hybrid=False, num_cpu_chunks=8)
    try:
        labels = {"model_name": "kvobs/cpu-harness", "engine": "0"}
        # The API server's side: the spec class named in the same extra_config declares the gauge.
        declared = OffloadingSpecFactory.get_spec_cls(extra).build_metric_definitions(extra)
        assert type(declared[GAUGE]).__name__ == "OffloadingGaugeMetadata"
        prom = KVConnectorProm(make_vllm_config(extra), ["model_name", "engine"], {0: list(labels.values())})
        stats = scheduler.get_stats()  # what EngineCore sends with a step's stats
        assert stats is not None
        prom.observe(stats.data, 0)
        assert REGISTRY.get_sample_value(GAUGE, {**labels, "part": "dir"}) == (0 if usable else 1)
        assert REGISTRY.get_sample_value(GAUGE, {**labels, "part": "flight_recorder"}) == 0
        later = scheduler.get_stats()  # unchanged: not sent again (vLLM's gauge keeps its value)
        assert later is None or GAUGE not in later.data["data"]
    finally:
        scheduler.shutdown()


def doctor_config(extra: dict[str, Any]) -> str:
    return json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"spec_name": "ObservedOffloadingSpec",
                                                     "spec_module_path": "kvobs.vllm", **extra}})


def lines(report: Any) -> dict[str, str]:
    return dict(report.lines)


def test_doctor_reports_an_unusable_directory_and_a_recorder_that_cannot_run(tmp_path: Path) -> None:
    report = diagnose(doctor_config({"cpu_bytes_to_use": 2**30, "kvobs": {"dir": "/proc/kvobs"}}))
    assert report.status == CONFIG_ERROR
    assert lines(report)["dir"].startswith("/proc/kvobs (option dir): not writable: ")
    assert DIR_LOST in lines(report)["dir"]
    assert report.data["dir"]["writable"] is False
    tiering = {"cpu_bytes_to_use": 2**30, "secondary_tiers": [{"type": "example"}],
               "kvobs": {"inner_spec": "TieringOffloadingSpec", "flight_calls": 2_000, "dir": str(tmp_path)}}
    report = diagnose(doctor_config(tiering))
    assert report.status == CONFIG_ERROR, report.render()
    assert lines(report)["flight recorder"].startswith("asked for (flight_calls=2000) but it cannot run on "
                                                       "TieringOffloadingManager: ")
    assert lines(report)["result"] != "kvobs will observe this engine"
    recorder = report.data["flight_recorder"]
    assert (recorder["asked"], recorder["runs"]) == (True, False) and "TieringOffloadingManager" in recorder["why_not"]
    cpu = {"cpu_bytes_to_use": 2**30, "kvobs": {"flight_calls": 2_000, "dir": str(tmp_path)}}
    report = diagnose(doctor_config(cpu))
    assert report.status == OBSERVES, report.render()
    assert lines(report)["flight recorder"].startswith("on: ") and lines(report)["result"] == \
        "kvobs will observe this engine"


@pytest.mark.parametrize(("tiers", "named"), [
    ([{"type": "nosuch"}], "Unknown secondary tier type: 'nosuch'"),
    ({"type": "example"}, "secondary_tiers must be a list"),
    ([{"type": "example", "bogus": 1}], "unexpected keyword argument 'bogus'"),
    ([{"type": "example", "backpressure": {
        "backpressure_cls": "vllm.v1.kv_offload.tiering.backpressure.EMABackpressureDetector", "alpha": 5}}],
     # vLLM's back-pressure detector checks its range; a release without back-pressure (0.30) refuses the key
     "alpha must be in (0, 1]" if VLLM >= (0, 31) else "unexpected keyword argument 'backpressure'"),
], ids=["unknown-type", "not-a-list", "unknown-parameter", "backpressure-range"])
def test_doctor_runs_vllms_own_checks_of_the_tier_settings(tiers: Any, named: str) -> None:
    extra = {"cpu_bytes_to_use": 2**30, "secondary_tiers": tiers, "kvobs": {"inner_spec": "TieringOffloadingSpec"}}
    report = diagnose(doctor_config(extra))
    assert report.status == CONFIG_ERROR, report.render()
    assert "vLLM" in lines(report)["settings"] and named in lines(report)["settings"], lines(report)["settings"]
    assert any(named in problem for problem in report.data["problems"])


def test_doctor_passes_settings_vllm_accepts() -> None:
    ok = diagnose(doctor_config({"cpu_bytes_to_use": 2**30, "secondary_tiers": [{"type": "example"}],
                                 "kvobs": {"inner_spec": "TieringOffloadingSpec"}}))
    assert ok.status == OBSERVES, ok.render()
    assert lines(ok)["settings"].endswith("own checks of TieringOffloadingSpec's settings pass")
    missing = diagnose(doctor_config({"kvobs": {}}))  # vLLM's CPU spec: cpu_bytes_to_use must be given
    assert missing.status == CONFIG_ERROR and "cpu_bytes_to_use must be specified" in lines(missing)["settings"]
