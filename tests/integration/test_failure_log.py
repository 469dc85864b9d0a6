"""Evidence that outlives the pod: a real ``kvobs serve`` logs one JSON line per failure report it
ingests, with the report's facts and where the sidecar serves it, and never again: not on re-reads,
not after a restart, not after a kill -9 right after the line.

The reports come from real failed loads: vLLM's real CPU manager under ``kvobs.observe()``.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.kv_offload.base import ReqContext

import kvobs
from kvobs.sidecar.log_format import FAILURE_EVENT
from tests.support.services import Sidecar, http_get, wait_for
from tests.support.vllm_env import cpu_extra, create_manager, evicted_after_lookup_then_coverage_mismatch, key


def fail(directory: Path, engine: str, model_name: str, req_id: str) -> None:
    """One real failed load (coverage_mismatch) of a fresh observed manager."""
    manager = kvobs.observe(create_manager(cpu_extra(2)), dir=str(directory), engine=engine, model_name=model_name)
    try:
        context = ReqContext(req_id)
        manager.on_new_request(context)
        with pytest.raises(AssertionError, match="cause: coverage_mismatch"):
            manager.prepare_load([key(7_000)], context)
    finally:
        manager.shutdown()


def served(sidecar: Sidecar) -> dict[str, dict[str, Any]]:
    status, _, body = http_get(f"{sidecar.url}/api/v1/failures")
    assert status == 200
    return {r["id"]: r for r in json.loads(body)["failures"]}


def failure_count(sidecar: Sidecar) -> float:
    """kvobs_load_failures_total summed: what the sidecar's ingest has folded (not what the API reads)."""
    from prometheus_client.parser import text_string_to_metric_families

    body = http_get(f"{sidecar.url}/metrics")[2].decode()
    return sum(s.value for f in text_string_to_metric_families(body) for s in f.samples
               if s.name == "kvobs_load_failures_total")


def stop(sidecar: Sidecar, sig: int = signal.SIGTERM) -> list[str]:
    """Stop the sidecar (SIGTERM: it checkpoints on its way out; SIGKILL: it cannot); its stderr lines."""
    assert sidecar.proc is not None
    sidecar.proc.send_signal(sig)
    sidecar.proc.wait(timeout=15)
    return sidecar.log_lines()


def failure_lines(stderr: list[str]) -> list[dict[str, Any]]:
    out = []
    for line in stderr:
        if line.startswith("{"):
            entry = json.loads(line)
            if entry.get("event") == FAILURE_EVENT:
                out.append(entry)
    return out


def test_one_json_line_per_ingested_failure_and_none_again_after_restarts(tmp_path: Path) -> None:
    directory = tmp_path / "kvobs"
    manager = kvobs.observe(create_manager(cpu_extra(4)), dir=str(directory), engine="0", model_name="m-a")
    try:
        writer, victim = ReqContext("writer"), ReqContext("req-victim")
        for context in (writer, victim):
            manager.on_new_request(context)
        evicted_after_lookup_then_coverage_mismatch(manager, writer, victim)  # two reports
    finally:
        manager.shutdown()

    # The default log format (text): the failure lines are JSON all the same.
    sidecar = Sidecar(directory).start()
    reports = wait_for(lambda: len(served(sidecar)) == 2 and served(sidecar), what="two reports")
    wait_for(lambda: failure_count(sidecar) == 2, what="two failures ingested")
    one = {rid: json.loads(http_get(f"{sidecar.url}/api/v1/failures/{rid}")[2]) for rid in reports}
    missing = http_get(f"{sidecar.url}/api/v1/failures/000000000000000-0-1-1")[0]
    first_run = stop(sidecar)
    lines = failure_lines(first_run)
    assert sorted(line["report_id"] for line in lines) == sorted(reports), first_run
    for line in lines:
        report = reports[line["report_id"]]
        assert line["level"] == "warning" and line["logger"] == "kvobs.sidecar"
        assert (line["engine"], line["model_name"], line["request_id"]) == ("0", "m-a", "req-victim")
        assert line["cause"] == report["cause"] and line["causes"] == report["causes"]
        assert line["missing_keys"] == report["num_missing"] and line["load_keys"] == report["num_keys"]
        assert line["failure_time_unix"] == report["time"] and line["failure_time"].endswith("Z")
        assert line["kvobs_version"] == kvobs.__version__ and line["suppressed"] == 0
        # Where the sidecar serves the report: the line's path answers it.
        assert line["report_path"] == f"/api/v1/failures/{line['report_id']}"
        assert one[line["report_id"]] == report
    assert {line["cause"] for line in lines} == {"evicted_after_lookup", "coverage_mismatch"}
    assert missing == 404

    # A restart (JSON logs this time) reads its checkpoint: the two are not logged again; a new one is.
    sidecar = Sidecar(directory, "--log-format", "json").start()
    fail(directory, "1", "m-b", "req-later")
    wait_for(lambda: failure_count(sidecar) == 3, what="the third failure ingested")
    second_run = stop(sidecar)
    assert all(json.loads(line) for line in second_run)  # every line JSON
    (line,) = failure_lines(second_run)
    assert (line["engine"], line["model_name"], line["request_id"]) == ("1", "m-b", "req-later")

    # Killed (no checkpoint on its way out) right after it ingested a fourth: that round's checkpoint
    # already names it, so the next sidecar logs nothing.
    sidecar = Sidecar(directory).start()
    fail(directory, "1", "m-b", "req-last")
    wait_for(lambda: failure_count(sidecar) == 4, what="the fourth failure ingested")
    checkpoint = directory / "sidecar-state.json"
    wait_for(lambda: len(json.loads(checkpoint.read_bytes())["reports_seen"]) == 4, timeout=2.0,
             what="the checkpoint naming the fourth report (before the periodic one, 5 s)")
    (line,) = failure_lines(stop(sidecar, signal.SIGKILL))
    assert line["request_id"] == "req-last"
    sidecar = Sidecar(directory).start()
    wait_for(lambda: failure_count(sidecar) == 4, what="the restored counts")
    assert failure_lines(stop(sidecar)) == []


def test_one_report_by_id_is_guarded_like_the_list_and_takes_only_report_ids(tmp_path: Path) -> None:
    directory = tmp_path / "kvobs"
    fail(directory, "0", "m-a", "req-a")
    (report_id,) = (p.stem for p in (directory / "failures").glob("*.json"))
    (directory / "failures" / "notes.json").write_text("{}")  # a file that is not a report
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    sidecar = Sidecar(directory, "--token-file", str(token_file)).start()
    try:
        path = f"{sidecar.url}/api/v1/failures/{report_id}"
        assert http_get(path)[0] == 401
        status, _, body = http_get(path, {"Authorization": "Bearer s3cret"})
        assert status == 200 and json.loads(body)["id"] == report_id and json.loads(body)["req_id"] == "req-a"
        for other in ("notes", "..%2Fsidecar-state", "../sidecar-state", f"{report_id}.json", ""):
            assert http_get(f"{sidecar.url}/api/v1/failures/{other}", {"Authorization": "Bearer s3cret"})[0] == 404
    finally:
        sidecar.stop()
