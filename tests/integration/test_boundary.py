"""Caught at the boundary (issue 42): an exception leaving vLLM's real offloading connector through kvobs's
connector is reported (site, requests, span, counter, log line, failure report) and propagates unchanged.

Each scheduler-side method of vLLM's ``OffloadingConnector`` is driven on kvobs's connector, built as
``vllm serve`` builds it over vLLM's CPU spec; the vLLM method it calls (of the real
``OffloadingConnectorScheduler``, or the worker) is replaced by one that fails a real ``assert`` here.
The site is the innermost frame inside vLLM's package (vLLM's connector method, the line of that call);
where it was raised (this file's assert) is the report's ``raised_at``.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from demo import driver
from demo.engine import counter_samples
from kvobs.tracing import TracingSink
from kvobs.vllm import compat, modelless_config
from kvobs.vllm.boundary import boundary_of
from kvobs.wire.decode import iter_reports
from tests.support.services import Sidecar, http_get, wait_for

CONNECTOR_FILE = "distributed/kv_transfer/kv_connector/v1/offloading_connector.py"
INNER = {"request_finished_all_groups": "request_finished", "get_kv_connector_stats": "get_stats"}
"""The vLLM method each connector method calls, where its name differs."""
SCHEDULER_METHODS = [m for m in compat.CONNECTOR_SCHEDULER_METHODS if m in vars(OffloadingConnector)]


def connectors(tmp_path: Path) -> tuple[Any, Any, InMemorySpanExporter]:
    """kvobs's connector (scheduler and worker sides) over vLLM's CPU spec, journaling into ``tmp_path``,
    its spans into the returned exporter."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvobs.vllm.connector import ObservedOffloadingConnector

    kv_cache_config = modelless_config.make_kv_cache_config(hybrid=False)
    extra: dict[str, Any] = {"spec_name": "ObservedOffloadingSpec", "spec_module_path": "kvobs.vllm",
                             "kvobs": {"inner_spec": "CPUOffloadingSpec", "dir": str(tmp_path)}}
    probe = modelless_config.make_offloading_config(modelless_config.make_vllm_config(extra), kv_cache_config)
    extra["cpu_bytes_to_use"] = driver.cpu_bytes_for_chunks(probe, 16)
    facts = modelless_config.ModelFacts()
    config = modelless_config.WithModelFacts(modelless_config.make_vllm_config(extra))
    config.model_config = types.SimpleNamespace(  # type: ignore[assignment]
        **{f.name: getattr(facts, f.name) for f in dataclasses.fields(facts)},
        get_total_num_kv_heads=facts.get_total_num_kv_heads)
    scheduler = ObservedOffloadingConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    worker = ObservedOffloadingConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    connector_scheduler: Any = scheduler.connector_scheduler
    manager = connector_scheduler.manager
    for sink in manager.observer.sinks:
        if isinstance(sink, TracingSink):
            sink._given = provider  # the test's provider: what any exporter would get
    boundary_of(worker)._tracing = TracingSink(provider)
    return scheduler, worker, exporter


class Injected:
    """A vLLM method replaced by one that fails a real assert (the exception it raised is kept)."""

    def __init__(self) -> None:
        self.raised: list[BaseException] = []
        self.args: tuple[Any, ...] = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            _injected_assert(len(args))
        except AssertionError as exc:
            self.raised.append(exc)
            self.args = exc.args
            raise


def _injected_assert(num_args: int) -> None:
    assert num_args < 0, (
        "injected")


def call(connector: Any, method: str, request: Any) -> Any:
    """The connector's ``method`` with the arguments vLLM's scheduler passes it."""
    output = types.SimpleNamespace(num_scheduled_tokens={request.request_id: 16}, finished_req_ids=set())
    args: dict[str, tuple[Any, ...]] = {
        "on_new_request": (request,), "get_num_new_matched_tokens": (request, 0),
        "get_external_cache_hit_sources": (request, 16), "update_state_after_alloc": (request, None, 0),
        "build_connector_meta": (output,), "update_connector_output": (None,),
        "request_finished": (request, []), "request_finished_all_groups": (request, ([],)),
    }
    return getattr(connector, method)(*args.get(method, ()))


def expected_site(method: str) -> tuple[int, str]:
    """(line, source) of the call in vLLM's connector method that reaches the injected method."""
    lines, first = inspect.getsourcelines(getattr(OffloadingConnector, method))
    inner = INNER.get(method, method)
    (at,) = [i for i, line in enumerate(lines) if f"connector_scheduler.{inner}(" in line]
    return first + at, lines[at].strip()


@pytest.mark.parametrize("method", SCHEDULER_METHODS)
def test_an_exception_at_a_scheduler_side_method_is_reported_at_its_site_and_propagates_unchanged(
    method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    scheduler, _worker, exporter = connectors(tmp_path)
    observer = scheduler.connector_scheduler.manager.observer
    try:
        request = driver.make_request("req-42", list(range(1, 40)))
        scheduler.on_new_request(request)  # its lifecycle so far, as kvobs's connector saw it
        scheduler.get_num_new_matched_tokens(request, 0)
        injected = Injected()
        monkeypatch.setattr(scheduler.connector_scheduler, INNER.get(method, method), injected)
        caplog.set_level(logging.ERROR, logger="kvobs")
        with pytest.raises(AssertionError) as info:
            call(scheduler, method, request)
        assert injected.raised == [info.value] and info.value.args == injected.args, "the same object, untouched"

        line, source = expected_site(method)
        (report,) = [r for r in iter_reports(tmp_path / "failures")]
        label = report["site_label"]
        file_part = label[: -len(method) - 1]
        assert label.endswith(f":{method}") and len(label) <= 49 and CONNECTOR_FILE.endswith(file_part)
        assert file_part.endswith("offloading_connector.py") or len(label) == 49
        assert observer.counts["exceptions"][f"vllm_assertion {label}"] == 1
        site = report["site"]
        assert (site["file"], site["function"], site["line"]) == (CONNECTOR_FILE, method, line)
        assert source.rstrip("(") in site["expression"]
        raised = report["raised_at"]
        assert (raised["file"], raised["function"], raised["statement"]) == (
            "test_boundary.py", "_injected_assert", "assert")
        assert raised["expression"] == "num_args < 0"
        assert report["cause"] == "vllm_assertion" and report["method"] == method and report["side"] == "scheduler"
        assert report["releases"]["vllm"] == compat.VLLM_VERSION and report["not_recorded"]
        if method not in ("build_connector_meta", "update_connector_output", "has_pending_push_work",
                          "take_events", "reset_cache", "get_kv_connector_stats"):
            (story,) = report["requests"]
            assert story["req_id"] == "req-42"
            assert [e["method"] for e in story["events"]][:2] == ["on_new_request", "get_num_new_matched_tokens"]
        assert report["events"][-1]["method"] == method

        (span,) = [s for s in exporter.get_finished_spans() if s.name == f"kv_offload.{method}"]
        assert span.status.status_code is StatusCode.ERROR
        assert span.attributes is not None and span.attributes["error.type"] == "vllm_assertion"
        (event,) = [e for e in span.events if e.name == "kv_offload.exception_site"]
        assert event.attributes is not None and event.attributes["kv_offload.site.line"] == line
        assert report["trace_id"] == format(span.context.trace_id, "032x")

        (line_logged,) = [r for r in caplog.records if r.getMessage().startswith("kv offload exception at ")]
        assert f"{CONNECTOR_FILE}:{line} in {method}" in line_logged.getMessage()
        assert line_logged.kvobs_exception["site"] == label  # type: ignore[attr-defined]
        assert sum(observer.internal_errors.values()) == 0
    finally:
        monkeypatch.undo()
        scheduler.shutdown()


def test_a_worker_side_exception_is_logged_and_spanned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker side has no manager, so no observer: the log line, the span, an in-process count, and a
    failure report of its own (``side`` worker), which a real ``kvobs serve`` serves and counts in
    ``kvobs_offload_exceptions_total`` (the worker writes no journal; the scheduler side's reports are not
    counted again, since its journal's totals carry them)."""
    scheduler, worker, exporter = connectors(tmp_path)
    sidecar = Sidecar(tmp_path)
    try:
        injected = Injected()
        monkeypatch.setattr(worker.connector_worker, "start_kv_transfers", injected)
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata

        worker.bind_connector_metadata(OffloadingConnectorMetadata(load_jobs={}, store_jobs={}))
        caplog.set_level(logging.ERROR, logger="kvobs")
        with pytest.raises(AssertionError) as info:
            worker.start_load_kv(None)
        assert [info.value] == injected.raised
        boundary = boundary_of(worker)
        assert boundary.side == "worker"
        assert boundary.counts == {"vllm_assertion v1/offloading_connector.py:start_load_kv": 1}
        (span,) = [s for s in exporter.get_finished_spans() if s.name == "kv_offload.start_load_kv"]
        assert span.attributes is not None and span.attributes["kv_offload.side"] == "worker"
        assert any(r.getMessage().startswith("kv offload exception at ") for r in caplog.records)
        (report,) = list(iter_reports(tmp_path / "failures"))
        assert (report["side"], report["method"], report["cause"], report["engine"]) == (
            "worker", "start_load_kv", "vllm_assertion", "0")
        assert report["site_label"] == "v1/offloading_connector.py:start_load_kv"
        assert report["trace_id"] == f"{span.context.trace_id:032x}"

        with pytest.raises(AssertionError):  # the scheduler side's, counted through its journal's totals
            scheduler.start_load_kv(None)
        sidecar.start()

        def counted() -> dict[tuple[tuple[str, str], ...], float]:
            text = http_get(f"{sidecar.url}/metrics")[2].decode()
            return {k: v for k, v in counter_samples(text, "kvobs_offload_exceptions").items() if v}

        site = dict(cause="vllm_assertion", engine="0", model_name="kvobs/cpu-harness",
                    site="v1/offloading_connector.py:start_load_kv")
        wait_for(lambda: sum(counted().values()) == 2, what="both exceptions counted")
        assert counted() == {tuple(sorted(site.items())): 2.0}, counted()
        status, _, body = http_get(f"{sidecar.url}/api/v1/failures?cause=vllm_assertion")
        assert status == 200 and sorted(r["side"] for r in json.loads(body)["failures"]) == ["scheduler", "worker"]
    finally:
        monkeypatch.undo()
        sidecar.stop()
        scheduler.shutdown()


def test_a_real_vllm_assertion_is_named_with_its_expression(tmp_path: Path) -> None:
    """vLLM's own assert, unpatched: a worker-side call on the scheduler's connector fails
    ``assert self.connector_worker is not None`` in vLLM's ``OffloadingConnector.start_load_kv``."""
    scheduler, _worker, _exporter = connectors(tmp_path)
    try:
        with pytest.raises(AssertionError):
            scheduler.start_load_kv(None)
        (report,) = list(iter_reports(tmp_path / "failures"))
        lines, first = inspect.getsourcelines(OffloadingConnector.start_load_kv)
        (at,) = [i for i, line in enumerate(lines) if "assert self.connector_worker is not None" in line]
        assert report["site"] == {"file": CONNECTOR_FILE, "function": "start_load_kv", "line": first + at,
                                  "expression": "self.connector_worker is not None", "statement": "assert"}
        assert report["raised_at"] is None
        # The sidecar reads both: the report (served as read, not a load failure) and the counter, by site.
        from kvobs.sidecar.ingest import Ingest
        from kvobs.sidecar.metrics import KvobsCollector

        ingest = Ingest(tmp_path)
        ingest.poll()
        assert not ingest.state.unknown
        (family,) = [f for f in KvobsCollector(ingest).collect() if f.name == "kvobs_offload_exceptions"]
        counted = {(s.labels["cause"], s.labels["site"]): s.value for s in family.samples if s.name.endswith("_total")}
        assert counted == {("vllm_assertion", ""): 0, ("vllm_exception", ""): 0,
                           ("vllm_assertion", "v1/offloading_connector.py:start_load_kv"): 1}
        assert not [f for f in KvobsCollector(ingest).collect() if f.name == "kvobs_load_failures"
                    and any(s.labels.get("cause") == "vllm_assertion" for s in f.samples)]
        # /api/v1/failures filters it by its cause (the alert KvobsOffloadException's runbook asks for it).
        from kvobs.sidecar.failures import FailureQuery, failure_page

        (served,), _ = failure_page(tmp_path / "failures", FailureQuery.parse("cause=vllm_assertion"))
        assert served["site"]["function"] == "start_load_kv"
        assert failure_page(tmp_path / "failures", FailureQuery.parse("cause=vllm_exception")) == ([], None)
    finally:
        scheduler.shutdown()


def test_a_failed_load_kvobs_explains_is_reported_once_as_before(tmp_path: Path) -> None:
    """prepare_load's explanation is unchanged: the boundary does not report it a second time."""
    scheduler, _worker, _exporter = connectors(tmp_path)
    observer = scheduler.connector_scheduler.manager.observer
    try:
        observer.explained.append(exc := AssertionError("explained"))
        boundary_of(scheduler).left("build_connector_meta", exc, ())
        assert list(iter_reports(tmp_path / "failures")) == []
        assert sum(observer.counts["exceptions"].values()) == 0
    finally:
        scheduler.shutdown()


def test_an_exception_leaving_the_manager_under_vllms_own_connector_is_reported_by_the_taps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """kvobs's spec under vLLM's own connector scheduler (no kvobs connector above it): an exception leaving
    vLLM's manager (here its lookup: demo.defects.LookupRaisesSpec, OSError EIO, as a failed tier) is reported
    by the manager's taps, side ``manager`` (report, span, counter, log line), and propagates unchanged."""
    from demo.engine import DEFECT_TRIGGER_ENV

    trigger = tmp_path / "trigger"
    monkeypatch.setenv(DEFECT_TRIGGER_ENV, str(trigger))
    directory = tmp_path / "kvobs"
    extra = {"spec_name": "ObservedOffloadingSpec", "spec_module_path": "kvobs.vllm",
             "kvobs": {"inner_spec": "LookupRaisesSpec", "inner_spec_module_path": "demo.defects",
                       "dir": str(directory)}}
    scheduler, _, kv_cache_config = driver.build_scheduler(extra, hybrid=False, num_cpu_chunks=16)
    observer = scheduler.manager.observer
    assert not observer.guarded, "vLLM's own connector: no kvobs boundary above the manager"
    caplog.set_level(logging.ERROR, logger="kvobs")
    try:
        steps = driver.EngineStepDriver(scheduler, kv_cache_config)
        trigger.touch()
        with pytest.raises(OSError, match="could not be read") as info:
            steps.step([driver.make_request("r1", list(range(1, 4 * modelless_config.BLOCK_SIZE + 2)))])
        assert info.value.errno == 5  # vLLM's caller gets the tier's exception unchanged
        (report,) = list(iter_reports(directory / "failures"))
        assert (report["side"], report["method"], report["cause"], report["req_ids"]) == (
            "manager", "lookup", "vllm_exception", ["r1"])
        # Raised below vLLM's code (the injected tier), and the taps see the traceback up to themselves.
        assert report["site"] is None and report["raised_at"]["function"] == "lookup_that_raises"
        assert +observer.counts["exceptions"] == {"vllm_exception": 1}
        (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv offload exception at ")]
        assert "at outside vLLM's package; raised at defects.py:" in line
        assert "; through the offload manager's lookup; OSError: " in line
    finally:
        scheduler.shutdown()


def test_a_vllm_assertion_inside_the_manager_is_named_at_its_site_by_the_taps(tmp_path: Path) -> None:
    """vLLM's own assert inside its CPU manager, reached through a tapped method with no kvobs connector: a
    ``complete_load`` of a chunk nobody pinned fails ``assert chunk.ref_cnt > 0`` (every release). The flight
    recorder taps ``complete_load`` (without it kvobs does not sit on that method: docs/vllm.md)."""
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key

    directory = tmp_path / "kvobs"
    extra = {"spec_name": "ObservedOffloadingSpec", "spec_module_path": "kvobs.vllm",
             "kvobs": {"inner_spec": "CPUOffloadingSpec", "dir": str(directory), "flight_calls": 1000}}
    scheduler, _, _ = driver.build_scheduler(extra, hybrid=False, num_cpu_chunks=16)
    manager = scheduler.manager
    try:
        key, ctx = make_offload_key(b"\x07" * 32, 0), ReqContext("req-x")
        assert manager.prepare_store([key], ctx) is not None
        manager.complete_store([key], ctx)
        with pytest.raises(AssertionError, match="ref_cnt is already 0"):
            manager.complete_load([key], ctx)
        (report,) = list(iter_reports(directory / "failures"))
        assert (report["side"], report["method"], report["cause"], report["req_ids"]) == (
            "manager", "complete_load", "vllm_assertion", ["req-x"])
        site = report["site"]
        assert (site["file"], site["function"], site["statement"], site["expression"]) == (
            "v1/kv_offload/cpu/manager.py", "complete_load", "assert", "chunk.ref_cnt > 0")
        assert +manager.observer.counts["exceptions"] == {f"vllm_assertion {report['site_label']}": 1}

        # The state is the manager's, and the recorder runs: a bundle whose window ends with that call, which
        # kvobs replay makes again on vLLM's bare manager, to the same assertion.
        from kvobs.vllm import bundle_replay

        (path,) = (directory / "replay").glob("*.kvobs-replay.zip")
        bundle = bundle_replay.load(str(path))
        assert bundle.failure is not None and (bundle.failure["method"], bundle.failure["exception_type"]) == (
            "complete_load", "AssertionError")
        assert [c[0] for c in bundle.calls][-3:] == ["prepare_store", "complete_store", "complete_load"]
        outcome = bundle_replay.replay(bundle)
        assert outcome.reproduces(bundle), outcome
        kept = bundle_replay.minimize(bundle, budget_s=30)
        assert [bundle.calls[i][0] for i in kept] == ["prepare_store", "complete_load"]  # the chunk, unpinned
        assert bundle_replay.replay(bundle, kept).reproduces(bundle)
        from kvobs.vllm import emit

        test_file = tmp_path / "test_emitted.py"
        test_file.write_text(emit.render(bundle, kept), encoding="utf-8")
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert run.returncode == 1 and "ref_cnt is already 0" in run.stdout, run.stdout[-2000:]

        with pytest.raises(AssertionError, match="ref_cnt is already 0"):  # again at once: reported, no bundle
            manager.complete_load([key], ctx)
        assert len(list(iter_reports(directory / "failures"))) == 2
        assert len(list((directory / "replay").glob("*.kvobs-replay.zip"))) == 1, "at most one a minute"
    finally:
        scheduler.shutdown()


def test_the_boundary_leaves_the_connectors_attributes_inline(tmp_path: Path) -> None:
    """Each connector's boundary is kept as an attribute, not through its ``__dict__``: vLLM's connector code
    on it stays specialised (tests/integration/test_inline_attributes.py, for the managers)."""
    scheduler, worker, _ = connectors(tmp_path)
    try:
        assert boundary_of(scheduler) is boundary_of(scheduler) and boundary_of(worker).side == "worker"
        made_real = [side for side, connector in (("scheduler", scheduler), ("worker", worker),
                                                  ("scheduler's", scheduler.connector_scheduler))
                     if compat.real_dict(connector) is not None]
        assert made_real == [], f"kvobs gave the {made_real} connector a real __dict__"
    finally:
        worker.shutdown()
        scheduler.shutdown()
