"""`kvobs explain` on the log of an EngineCore killed by an exception in vLLM's offloading code (issue 42, item 3).

Real parts: vLLM's connector (kvobs's connector over vLLM's CPU spec, built as tests/integration/test_boundary.py
builds it), the exception it propagates (vLLM's own ``assert self.connector_worker is not None``, and an
injected assert under ``update_state_after_alloc``), its traceback (``traceback.format_exception``), kvobs's
ERROR line and the failure report kvobs wrote. The log around them is vLLM's: every line of a record carries
``(EngineCore_DP0 pid=...) ERROR <time> [core.py:...]`` as vLLM's NewLineFormatter writes it.
"""

from __future__ import annotations

import inspect
import json
import logging
import traceback
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from demo import driver
from tests.integration.test_boundary import CONNECTOR_FILE, Injected, call, connectors, expected_site
from tests.integration.test_explain import explain

PREFIX = "(EngineCore_DP0 pid=4242) ERROR 12-06 23:08:53 [core.py:1155] "
KVOBS_PREFIX = "(EngineCore_DP0 pid=4242) ERROR 12-06 23:08:52 [boundary.py:97] "


def _log(exc: BaseException, kvobs_lines: list[str]) -> str:
    """vLLM's log of the death: kvobs's line (when kvobs ran), then EngineCore's ``logger.exception``."""
    text = "EngineCore encountered a fatal error.\n" + "".join(traceback.format_exception(exc))
    lines = [KVOBS_PREFIX + line for line in kvobs_lines]
    lines += [PREFIX + line for line in text.rstrip("\n").split("\n")]
    return "(APIServer pid=4200) INFO 12-06 23:08:50 [api_server.py:1] Started.\n" + "\r\n".join(lines) + "\n"


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def deaths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two real deaths, each in a kvobs directory of its own: vLLM's own assert, and an injected one."""
    base = tmp_path_factory.mktemp("deaths")
    out: dict[str, Any] = {}
    handler = _Kept()
    records = handler.records
    logger = logging.getLogger("kvobs")
    logger.addHandler(handler)
    try:
        directory = base / "real"
        scheduler, _worker, _exporter = connectors(directory)
        try:
            with pytest.raises(AssertionError) as info:
                scheduler.start_load_kv(None)
        finally:
            scheduler.shutdown()
        lines, first = inspect.getsourcelines(OffloadingConnector.start_load_kv)
        (at,) = [i for i, line in enumerate(lines) if "assert self.connector_worker is not None" in line]
        kvobs_lines = [r.getMessage() for r in records if r.getMessage().startswith("kv offload exception at ")]
        assert len(kvobs_lines) == 1
        (base / "real-kvobs.log").write_text(_log(info.value, kvobs_lines))
        (base / "real-bare.log").write_text(_log(info.value, []))
        out["real"] = {"dir": directory, "line": first + at, "kvobs": base / "real-kvobs.log",
                       "bare": base / "real-bare.log"}

        records.clear()
        directory = base / "injected"
        scheduler, _worker, _exporter = connectors(directory)
        patch = pytest.MonkeyPatch()
        try:
            request = driver.make_request("req-42", list(range(1, 40)))
            scheduler.on_new_request(request)
            scheduler.get_num_new_matched_tokens(request, 0)
            patch.setattr(scheduler.connector_scheduler, "update_state_after_alloc", Injected())
            with pytest.raises(AssertionError) as info:
                call(scheduler, "update_state_after_alloc", request)
        finally:
            patch.undo()
            scheduler.shutdown()
        kvobs_lines = [r.getMessage() for r in records if r.getMessage().startswith("kv offload exception at ")]
        (base / "injected.log").write_text(_log(info.value, kvobs_lines))
        out["injected"] = {"dir": directory, "line": expected_site("update_state_after_alloc")[0],
                           "log": base / "injected.log"}
    finally:
        logger.removeHandler(handler)
    return out


def test_vllms_own_assertion_is_named_from_the_log_alone(deaths: dict[str, Any]) -> None:
    """No kvobs line, no directory: the traceback names the site and the asserted expression."""
    real = deaths["real"]
    run = explain(str(real["bare"]))
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert out.startswith(f"1 offload exception in {real['bare']}"), out
    assert (f"  site: {CONNECTOR_FILE}:{real['line']} in start_load_kv "
            "(assert self.connector_worker is not None)") in out
    assert "  exception: AssertionError\n" in out and "engine 0" in out and "logged 12-06 23:08:53" in out
    assert "seen in: vLLM traceback\n" in out
    assert '"kv_connector":"ObservedOffloadingConnector"' in out  # what to enable next time
    assert "no offload assertion found" not in out


def test_kvobs_line_and_traceback_are_one_death_with_its_report(deaths: dict[str, Any]) -> None:
    real = deaths["real"]
    run = explain(str(real["kvobs"]), "--dir", str(real["dir"]))
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert out.startswith(f"1 offload exception in {real['kvobs']}"), out
    assert "seen in: kvobs log line, vLLM traceback" in out
    assert "kvobs (in the log): through the connector's scheduler-side start_load_kv, cause vllm_assertion" in out
    assert "cause vllm_assertion, through scheduler-side start_load_kv" in out  # the report kvobs wrote
    run = explain(str(real["kvobs"]), "--dir", str(real["dir"]), "--json")
    assert run.returncode == 0, run.stderr
    [result] = json.loads(run.stdout)
    assert result["assertions"] == [] and result["exceptions_not_shown"] == 0
    [entry] = result["exceptions"]
    assert entry["site"] == {"file": CONNECTOR_FILE, "function": "start_load_kv", "line": real["line"],
                             "expression": "self.connector_worker is not None", "statement": "assert"}
    assert entry["exception_type"] == "AssertionError" and entry["seen_in"] == ["kvobs_log", "traceback"]
    assert entry["kvobs"]["cause"] == "vllm_assertion" and entry["kvobs"]["method"] == "start_load_kv"
    assert entry["report_causes"] == ["vllm_assertion"] and entry["report_methods"] == ["start_load_kv"]
    assert len(entry["reports"]) == 1 and entry["reports"][0]


def test_an_exception_under_a_request_shows_its_lifecycle_from_the_report(deaths: dict[str, Any]) -> None:
    """The site is the innermost frame inside vLLM (the connector's call), as kvobs's report names it; the
    report's request, req-42, is shown with its lifecycle as kvobs's connector saw it."""
    injected = deaths["injected"]
    run = explain(str(injected["log"]), "--dir", str(injected["dir"]))
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert f"  site: {CONNECTOR_FILE}:{injected['line']} in update_state_after_alloc" in out, out
    assert "exception: AssertionError: injected" in out
    assert "requests ['req-42']" in out
    assert "    req-42: on_new_request (" in out and " -> get_num_new_matched_tokens (" in out
    run = explain(str(injected["log"]), "--dir", str(injected["dir"]), "--json")
    [entry] = json.loads(run.stdout)[0]["exceptions"]
    [requests] = entry["report_requests"]
    assert requests[0]["req_id"] == "req-42"
    assert requests[0]["events"][:3] == ["on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc"]


def test_a_report_of_another_site_is_not_attached(deaths: dict[str, Any]) -> None:
    run = explain(str(deaths["real"]["bare"]), "--dir", str(deaths["injected"]["dir"]), "--json")
    [entry] = json.loads(run.stdout)[0]["exceptions"]
    assert entry["reports"] == []
    text = explain(str(deaths["real"]["bare"]), "--dir", str(deaths["injected"]["dir"])).stdout
    assert "kvobs data: no failure report of this site" in text


def test_sidecar_serves_the_report_of_the_site(deaths: dict[str, Any]) -> None:
    from tests.support.services import Sidecar

    injected = deaths["injected"]
    sidecar = Sidecar(injected["dir"]).start()
    try:
        run = explain(str(injected["log"]), "--sidecar", sidecar.url, "--json")
    finally:
        sidecar.stop()
    assert run.returncode == 0, run.stderr
    [entry] = json.loads(run.stdout)[0]["exceptions"]
    assert entry["report_methods"] == ["update_state_after_alloc"]
    assert entry["report_requests"][0][0]["req_id"] == "req-42"
